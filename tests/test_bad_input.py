"""Bad input is refused where it is given, and a message is what it was when made.

Each case let something through that failed later (in a worker, on the wire,
in a ``repr``), or changed what was sent after ``reply()`` accepted it.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
import telebot
from telebot import apihelper

from outbound import Defer, Dispatcher
from outbound.contrib.telebot import TeleBotSender
from outbound.errors import QueueFull, RateLimited
from outbound.messages import (
    MethodMessage,
    SendRequest,
    SendResult,
    TextMessage,
    check_json_params,
    check_text,
)
from outbound.reply import Outbound
from outbound.retry import RetryPolicy
from outbound.simulator import PlatformSimulator
from outbound.telegram import TelegramError, TelegramSender

LONE = "order \ud83d placed"  # half of an emoji pair: a lone high surrogate


def _strict(raw: str) -> object:
    def refuse(word: str) -> object:
        raise ValueError(f"not JSON: {word}")

    return json.loads(raw, parse_constant=refuse)


# ------------------------------------------------- a message is a snapshot


def test_params_changed_after_reply_do_not_change_the_queued_message() -> None:
    with PlatformSimulator() as sim:
        gate = threading.Event()
        with Dispatcher(max_inflight=2) as dispatcher:
            out = Outbound(dispatcher, TelegramSender(sim.token, base_url=sim.url))
            # The chat's lane is held, so the reply is still queued when the
            # caller reuses its dict (one message per recipient, in a loop).
            blocker = dispatcher.submit(out.lane_key(7), gate.wait, 10)
            params = {"photo": "file-1", "caption": "for Alice", "extra": {"tags": ["a"]}}
            first = out.reply(7, MethodMessage("sendPhoto", params))
            params["caption"] = "for Bob"
            params["extra"]["tags"].append("b")  # type: ignore[index]
            gate.set()
            blocker.result(timeout=10)
            first.result(timeout=10)
        sent = sim.received(7)
        assert [r["params"].get("caption") for r in sent] == ["for Alice"]
        assert [r["params"].get("extra") for r in sent] == [{"tags": ["a"]}]


def test_validated_text_cannot_be_emptied_after_reply() -> None:
    with PlatformSimulator() as sim:
        gate = threading.Event()
        with Dispatcher(max_inflight=2) as dispatcher:
            out = Outbound(dispatcher, TelegramSender(sim.token, base_url=sim.url))
            blocker = dispatcher.submit(out.lane_key(8), gate.wait, 10)
            params = {"text": "hello"}
            future = out.reply(8, MethodMessage("sendMessage", params))
            assert not future.done()  # accepted: validation passed
            params["text"] = ""
            gate.set()
            blocker.result(timeout=10)
            assert future.exception(timeout=10) is None
        assert [r["text"] for r in sim.received(8)] == ["hello"]


def test_params_are_copied_at_any_depth_and_cycles_are_refused() -> None:
    inner: list[object] = [1]
    params: dict[str, object] = {"a": inner, "b": {"c": inner}}
    message = MethodMessage("m", params)
    inner.append(2)
    assert message.params == {"a": [1], "b": {"c": [1]}}
    # one list reached twice stays one list in the copy
    assert message.params["a"] is message.params["b"]["c"]
    deep: list[object] = []
    cursor = deep
    for _ in range(sys.getrecursionlimit() + 100):  # no recursion in the copy
        nested: list[object] = []
        cursor.append(nested)
        cursor = nested
    MethodMessage("m", {"x": deep})
    # reached twice, and deep: the look for a cycle does not recurse either
    MethodMessage("m", {"x": deep, "y": deep})
    # A cycle is no JSON, and no read-only copy can be pickled (its own
    # argument): refused as the message is made, at any depth.
    looped: dict[str, object] = {}
    looped["self"] = looped
    with pytest.raises(TypeError, match="cycle"):
        MethodMessage("m", looped)
    ring: list[object] = [{"x": 1}]
    ring.append({"back": [ring]})
    with pytest.raises(TypeError, match="cycle"):
        MethodMessage("m", {"shared": ring[0], "ring": ring})
    cursor.append(deep)  # the end of the deep chain holds its start
    with pytest.raises(TypeError, match="cycle"):
        MethodMessage("m", {"x": deep})


def test_params_cannot_be_changed_once_the_message_is_made() -> None:
    # They were the message's own plain dict: an accepted, checked message
    # changed while queued (a NaN put in failed its send with a bare
    # ValueError; a caption went out changed to every chat it was queued for).
    message = MethodMessage("sendPhoto", {"photo": "p", "caption_entities": [{"offset": 0}]})
    params: Any = message.params  # (typed a Mapping: what a caller might still try)
    entities = params["caption_entities"]
    changes = [
        lambda: params.__setitem__("width", math.nan),
        lambda: params.update(width=1),
        lambda: params.setdefault("width", 1),
        lambda: params.pop("photo"),
        params.popitem,
        params.clear,
        lambda: params.__delitem__("photo"),
        lambda: params.__ior__({"width": 1}),
        lambda: entities.append({}),
        lambda: entities.__setitem__(0, {}),
        lambda: entities[0].__setitem__("offset", 5),
        lambda: entities.extend([{}]),
        lambda: entities.__iadd__([{}]),
        lambda: entities.__imul__(2),
        entities.sort,
        entities.clear,
    ]
    for change in changes:
        with pytest.raises(TypeError, match="read-only"):
            change()
    # __init__ again changes nothing (each is filled as it is made)
    params.__init__({"width": 1})
    entities.__init__([{}])
    entities[0].__init__(offset=5)
    assert params == {"photo": "p", "caption_entities": [{"offset": 0}]}
    # Still dicts and lists to whoever reads them.
    assert json.loads(json.dumps(params)) == params
    assert {**params, "chat_id": 1}["photo"] == "p"
    assert isinstance(params, dict)
    assert isinstance(entities, list)
    # Frozen, and now hashable; copied and pickled as what it is.
    assert hash(message) == hash(MethodMessage("sendPhoto", dict(params)))
    assert len({message, MethodMessage("sendPhoto", dict(params))}) == 1
    back = pickle.loads(pickle.dumps(message))
    assert back == message
    with pytest.raises(TypeError, match="read-only"):
        back.params["caption_entities"].append({})
    import copy  # noqa: PLC0415
    import dataclasses  # noqa: PLC0415

    assert copy.deepcopy(message) == message
    assert dataclasses.asdict(message)["params"] == params


@pytest.mark.parametrize("key", [b"abc", 123, ["k"]])
def test_an_idempotency_key_that_is_not_a_str_is_refused(key: object) -> None:
    with pytest.raises(TypeError, match="idempotency_key"):
        SendRequest(1, TextMessage("hi"), idempotency_key=key)  # type: ignore[arg-type]


# ----------------------------------------------- parameters that are JSON


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_parameters_that_are_not_json_numbers_are_refused(value: float) -> None:
    with pytest.raises(TypeError, match="sendPhoto"):
        check_json_params(MethodMessage("sendPhoto", {"photo": "p", "width": value}))


def test_colliding_keys_are_refused_naming_the_path() -> None:
    markup: dict[object, str] = {1: "a", "1": "b"}
    with pytest.raises(TypeError, match=r"\['markup'\] has a key of type int"):
        check_json_params(MethodMessage("sendPhoto", {"photo": "p", "markup": markup}))


def test_colliding_keys_never_reach_the_platform() -> None:
    with PlatformSimulator() as sim:
        with Outbound(None, TelegramSender(sim.token, base_url=sim.url)) as out:
            params: dict[object, str] = {"photo": "p", 1: "a", "1": "b"}
            future = out.reply(3, MethodMessage("sendPhoto", params))  # type: ignore[arg-type]
            assert isinstance(future.exception(timeout=10), TypeError)
        assert sim.received(3) == []


def test_deep_nesting_is_a_type_error() -> None:
    """Nesting deeper than json can encode (past the recursion limit; on 3.12+ the C
    encoder has a limit of its own, near 10,000: 200,000 is past every one)."""
    deep: list[object] = []
    cursor = deep
    for _ in range(max(200_000, sys.getrecursionlimit() + 100)):
        inner: list[object] = []
        cursor.append(inner)
        cursor = inner
    with pytest.raises(TypeError, match="nested too deeply"):
        check_json_params(MethodMessage("sendPhoto", {"photo": "p", "x": deep}))


def test_a_lone_surrogate_in_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        check_json_params(MethodMessage("sendPhoto", {"photo": "p", "caption": LONE}))


def test_the_body_sent_is_json() -> None:
    """TelegramSender.send, called without validate, puts no NaN on the wire."""
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            answer = b'{"ok":true,"result":{"message_id":1}}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sender = TelegramSender("123:abc", base_url=f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(ValueError):
            sender.send(SendRequest(1, MethodMessage("sendPhoto", {"photo": "p", "w": math.nan})))
        sender.send(SendRequest(1, MethodMessage("sendPhoto", {"photo": "p", "w": 1.5})))
        (body,) = bodies
        assert _strict(body.decode()) == {"photo": "p", "w": 1.5, "chat_id": 1}
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


# ------------------------------------------------------ lone surrogates


def test_check_text_refuses_a_lone_surrogate() -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        check_text(LONE, 4096)


def test_telegram_sender_refuses_a_lone_surrogate_before_queueing() -> None:
    with PlatformSimulator() as sim:
        out = Outbound(None, TelegramSender(sim.token, base_url=sim.url))
        try:
            future = out.reply_text(5, LONE)
            assert future.done()  # refused, not queued
            assert isinstance(future.exception(timeout=0), ValueError)
        finally:
            out.close(10)
        assert sim.received(5) == []


def test_telebot_sender_refuses_a_lone_surrogate_before_queueing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with PlatformSimulator() as sim:
        monkeypatch.setattr(apihelper, "API_URL", sim.url + "/bot{0}/{1}")
        out = Outbound(None, TeleBotSender(telebot.TeleBot(sim.token, threaded=False)))
        try:
            future = out.reply_text(5, LONE)
            assert future.done()
            assert isinstance(future.exception(timeout=0), ValueError)
        finally:
            out.close(10)
        assert sim.received(5) == []


# ----------------------------------------------------- numbers and limits


class _Sender:
    def send(self, request: SendRequest) -> SendResult:
        return SendResult(1)


@pytest.mark.parametrize("timeout", [True, "5", -1, math.nan])
def test_a_bad_close_timeout_is_refused_before_any_change(timeout: object) -> None:
    out = Outbound(None, _Sender())
    try:
        with pytest.raises((TypeError, ValueError), match="timeout"):
            out.close(timeout)  # type: ignore[arg-type]
        assert not out.closed
        assert out.reply_text(1, "hi").result(timeout=10).message_id == 1
    finally:
        out.close(10)
    assert out.dispatcher.state.name == "CLOSED"


def test_rate_limited_refuses_a_bool() -> None:
    with pytest.raises(TypeError, match="retry_after"):
        RateLimited(True)


@pytest.mark.parametrize("value", [None, "5"])
def test_rate_limited_names_retry_after_for_a_non_number(value: object) -> None:
    with pytest.raises(TypeError, match="retry_after"):
        RateLimited(value)  # type: ignore[arg-type]


def test_a_policy_with_an_int_too_large_to_print_has_a_repr() -> None:
    policy = RetryPolicy(max_total=10**5000, base_delay=1, max_delay=2)
    assert policy.max_total == math.inf
    assert "max_total=inf" in repr(policy)
    assert policy == RetryPolicy(max_total=math.inf, base_delay=1.0, max_delay=2.0)


class _Lazy(Mapping[str, object]):
    """A read-only view whose values are made as they are read (a valid Mapping)."""

    def __init__(self, lang: str) -> None:
        self.lang = lang

    def __getitem__(self, key: str) -> object:
        if key in ("title", "body"):
            return {"lang": self.lang, "part": key}
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("title", "body"))

    def __len__(self) -> int:
        return 2


def test_the_copy_of_values_made_as_they_are_read_is_theirs() -> None:
    """Values freed during the copy cannot lend their id to the next one's copy."""
    message = MethodMessage("sendCustom", {"en": _Lazy("en"), "fr": _Lazy("fr")})
    assert message.params == {
        "en": {"title": {"lang": "en", "part": "title"}, "body": {"lang": "en", "part": "body"}},
        "fr": {"title": {"lang": "fr", "part": "title"}, "body": {"lang": "fr", "part": "body"}},
    }


def test_lists_inside_tuples_are_copied_too() -> None:
    buttons = [{"text": "yes"}]
    message = MethodMessage("sendMessage", {"reply_markup": {"inline_keyboard": (buttons,)}})
    buttons.append({"text": "no"})  # the caller reuses its structure for the next chat
    buttons[0]["text"] = "changed"
    assert message.params == {"reply_markup": {"inline_keyboard": [[{"text": "yes"}]]}}


@pytest.mark.parametrize(
    "error",
    [
        RateLimited(3.0, "global", "sendMessage: Too Many Requests", stated=False),
        RateLimited(1.5),
        QueueFull(("chat", 7), 64),
        Defer(2.0, scope="all"),
        TelegramError(429, "Too Many Requests", {"retry_after": 3}, {"ok": False}),
    ],
    ids=repr,
)
def test_errors_with_their_own_arguments_round_trip_through_pickle(error: Exception) -> None:
    """A pool's result or a task queue's crosses processes pickled."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert vars(back) == vars(error)
