"""PlatformSimulator over real loopback HTTP, spoken to with plain http.client."""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest

from outbound.simulator import (
    DEFAULT_TOKEN,
    Fault,
    PlatformSimulator,
    SimulatorConfig,
    add_parser,
    config_from_args,
    main,
    run,
)

ROOT = Path(__file__).resolve().parent.parent


class Client:
    """One keep-alive connection to a simulator."""

    def __init__(self, sim: PlatformSimulator, timeout: float = 5.0) -> None:
        parts = urlsplit(sim.url)
        self.sim = sim
        self.conn = http.client.HTTPConnection(
            parts.hostname or "127.0.0.1", parts.port, timeout=timeout
        )

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, http.client.HTTPMessage]:
        self.conn.request(method, path, body, headers or {})
        response = self.conn.getresponse()
        data = response.read()
        return response.status, json.loads(data), response.headers

    def telegram(
        self, method: str, params: dict[str, Any], *, token: str | None = None, form: bool = False
    ) -> tuple[int, Any]:
        path = f"/bot{token or self.sim.token}/{method}"
        if form:
            body = urlencode(params).encode()
            ctype = "application/x-www-form-urlencoded"
        else:
            body = json.dumps(params).encode()
            ctype = "application/json"
        status, payload, _ = self.raw("POST", path, body, {"Content-Type": ctype})
        return status, payload

    def send(self, chat_id: Any, text: str = "hello") -> tuple[int, Any]:
        return self.telegram("sendMessage", {"chat_id": chat_id, "text": text})

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def sim() -> Iterator[PlatformSimulator]:
    with PlatformSimulator() as simulator:
        yield simulator


@pytest.fixture
def client(sim: PlatformSimulator) -> Iterator[Client]:
    c = Client(sim)
    yield c
    c.close()


def texts(sim: PlatformSimulator, chat_id: int | str) -> list[str]:
    return [m["text"] for m in sim.received(chat_id)]


# ------------------------------------------------------------------ basics


def test_send_message_answers_like_telegram(sim: PlatformSimulator, client: Client) -> None:
    status, payload = client.send(42, "hi")
    assert status == 200
    assert payload["ok"] is True
    assert payload["result"]["message_id"] == 1
    assert payload["result"]["chat"]["id"] == 42
    assert payload["result"]["text"] == "hi"
    assert client.send(42, "again")[1]["result"]["message_id"] == 2
    assert client.send(7, "other")[1]["result"]["message_id"] == 1


def test_records_per_chat_and_overall_in_arrival_order(
    sim: PlatformSimulator, client: Client
) -> None:
    for i in range(5):
        client.send(1, f"a{i}")
        client.send(2, f"b{i}")
    assert texts(sim, 1) == [f"a{i}" for i in range(5)]
    assert texts(sim, 2) == [f"b{i}" for i in range(5)]
    assert [m["text"] for m in sim.all_received()][:4] == ["a0", "b0", "a1", "b1"]
    record = sim.received(1)[0]
    assert record["platform"] == "telegram"
    assert record["method"] == "sendMessage"
    assert record["chat_id"] == 1
    assert record["params"] == {"chat_id": 1, "text": "a0"}
    assert sim.received(3) == []


def test_records_under_concurrent_clients_keep_each_clients_order(sim: PlatformSimulator) -> None:
    errors: list[BaseException] = []

    def run_client(chat: int) -> None:
        c = Client(sim)
        try:
            for i in range(20):
                assert c.send(chat, str(i))[0] == 200
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=run_client, args=(chat,)) for chat in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    for chat in range(4):
        assert texts(sim, chat) == [str(i) for i in range(20)]
    assert sim.stats().delivered == 80
    assert sim.stats().connections == 4


def test_form_body_query_string_and_string_chat_ids(sim: PlatformSimulator, client: Client) -> None:
    assert client.telegram("sendMessage", {"chat_id": "-100", "text": "x"}, form=True)[0] == 200
    status, payload, _ = client.raw(
        "GET", f"/bot{sim.token}/sendMessage?{urlencode({'chat_id': 5, 'text': 'q'})}"
    )
    assert status == 200
    assert payload["result"]["chat"] == {"id": 5, "type": "private"}
    assert client.send("@news_channel")[0] == 200
    assert texts(sim, -100) == ["x"]
    assert texts(sim, "-100") == ["x"]
    assert texts(sim, "5") == ["q"]
    assert len(sim.received("@news_channel")) == 1


def test_other_methods_are_recorded_with_their_params(
    sim: PlatformSimulator, client: Client
) -> None:
    status, payload = client.telegram("sendPhoto", {"chat_id": 9, "photo": "file-1"})
    assert status == 200
    assert payload["result"]["message_id"] == 1
    assert sim.received(9)[0]["method"] == "sendPhoto"
    assert sim.received(9)[0]["params"]["photo"] == "file-1"
    assert client.telegram("getMe", {})[1]["result"]["is_bot"] is True
    assert client.telegram("getUpdates", {})[1] == {"ok": True, "result": True}
    assert sim.stats().delivered == 1


@pytest.mark.parametrize(
    ("params", "description"),
    [
        ({"chat_id": 1}, "Bad Request: message text is empty"),
        ({"chat_id": 1, "text": "   "}, "Bad Request: message text is empty"),
        ({"chat_id": 1, "text": "x" * 4097}, "Bad Request: message is too long"),
        ({"text": "x"}, "Bad Request: chat_id is empty"),
        ({"chat_id": "general", "text": "x"}, "Bad Request: chat not found"),
        ({"chat_id": True, "text": "x"}, "Bad Request: chat not found"),
        ({"chat_id": 1.5, "text": "x"}, "Bad Request: chat not found"),
    ],
)
def test_bad_requests_get_400(
    sim: PlatformSimulator, client: Client, params: dict[str, Any], description: str
) -> None:
    status, payload = client.telegram("sendMessage", params)
    assert status == 400
    assert payload == {"ok": False, "error_code": 400, "description": description}
    assert sim.all_received() == []
    assert sim.stats().rejected == 1


def test_text_of_exactly_the_limit_is_accepted(sim: PlatformSimulator, client: Client) -> None:
    assert client.send(1, "x" * 4096)[0] == 200


def test_bad_json_wrong_token_and_unknown_path(sim: PlatformSimulator, client: Client) -> None:
    status, payload, _ = client.raw(
        "POST", f"/bot{sim.token}/sendMessage", b"{nope", {"Content-Type": "application/json"}
    )
    assert (status, payload["error_code"]) == (400, 400)
    status, payload = client.telegram("sendMessage", {"chat_id": 1, "text": "x"}, token="1:bad")
    assert (status, payload["description"]) == (401, "Unauthorized")
    status, payload, _ = client.raw("GET", "/nowhere")
    assert status == 404
    assert payload["ok"] is False
    assert sim.all_received() == []


# ------------------------------------------------------------------ limits


def test_per_chat_limit_answers_429_for_that_chat_only() -> None:
    with PlatformSimulator(chat_rate=1.0) as sim:
        c = Client(sim)
        try:
            assert c.send(1)[0] == 200
            status, payload = c.send(1)
            assert status == 429
            assert payload["error_code"] == 429
            assert payload["parameters"]["scope"] == "chat"
            assert 0.9 <= payload["parameters"]["retry_after"] <= 1.0
            assert payload["description"].startswith("Too Many Requests: retry after ")
            assert c.send(2)[0] == 200
        finally:
            c.close()
        s = sim.stats()
        assert (s.rate_limited, s.chat_limited, s.global_limited, s.delivered) == (1, 1, 0, 2)
        assert texts(sim, 1) == ["hello"]


def test_global_limit_answers_429_with_global_scope() -> None:
    with PlatformSimulator(global_rate=2.0) as sim:
        c = Client(sim)
        try:
            assert c.send(1)[0] == 200
            assert c.send(2)[0] == 200
            status, payload = c.send(3)
            assert status == 429
            assert payload["parameters"]["scope"] == "global"
            assert 0 < payload["parameters"]["retry_after"] <= 0.5
        finally:
            c.close()
        assert sim.stats().global_limited == 1
        assert sim.received(3) == []


def test_group_limit_applies_to_negative_ids_only() -> None:
    with PlatformSimulator(group_rate=6.0) as sim:
        c = Client(sim)
        try:
            assert c.send(-5)[0] == 200
            status, payload = c.send(-5)
            assert status == 429
            assert payload["parameters"]["scope"] == "group"
            assert 9.9 <= payload["parameters"]["retry_after"] <= 10.0
            for _ in range(3):
                assert c.send(5)[0] == 200
        finally:
            c.close()
        assert sim.stats().group_limited == 1


def test_longest_wait_decides_the_scope() -> None:
    with PlatformSimulator(global_rate=10.0, global_burst=1.0, chat_rate=0.5) as sim:
        c = Client(sim)
        try:
            assert c.send(1)[0] == 200
            status, payload = c.send(1)
        finally:
            c.close()
        assert status == 429
        assert payload["parameters"]["scope"] == "chat"
        assert payload["parameters"]["retry_after"] > 1.0


def test_whole_second_retry_after() -> None:
    with PlatformSimulator(chat_rate=10.0, chat_burst=1.0, whole_second_retry_after=True) as sim:
        c = Client(sim)
        try:
            c.send(1)
            status, payload = c.send(1)
        finally:
            c.close()
        assert status == 429
        assert payload["parameters"]["retry_after"] == 1
        assert type(payload["parameters"]["retry_after"]) is int  # (as Telegram says it: 1.0 was)


def test_client_within_the_rate_never_sees_429_one_above_it_does() -> None:
    rate = 50.0
    with PlatformSimulator(chat_rate=rate, chat_burst=1.0, global_rate=rate) as sim:
        c = Client(sim)
        try:
            answered = -math.inf
            for i in range(10):
                # Pacing at the limit is the behaviour under test: each send
                # 1/rate after the previous answer, so the server, which
                # decided before answering, sees them at least 1/rate apart
                # however late a loaded machine runs either side.
                time.sleep(max(0.0, answered + 1.0 / rate - time.monotonic()))
                assert c.send(1, str(i))[0] == 200
                answered = time.monotonic()
            assert sim.stats().rate_limited == 0
            statuses = [c.send(2, str(i))[0] for i in range(10)]
        finally:
            c.close()
        assert 429 in statuses
        assert statuses[0] == 200


def test_refused_requests_take_no_token() -> None:
    with PlatformSimulator(chat_rate=1.0, global_rate=1.0, global_burst=3.0) as sim:
        c = Client(sim)
        try:
            assert c.send(1)[0] == 200
            assert c.send(1)[0] == 429
            assert c.send(1)[0] == 429
            assert c.send(2)[0] == 200
            assert c.send(3)[0] == 200
        finally:
            c.close()


def test_configure_and_reset() -> None:
    with PlatformSimulator() as sim:
        c = Client(sim)
        try:
            assert c.send(1)[0] == 200
            assert sim.configure(chat_rate=1.0).chat_rate == 1.0
            assert c.send(1)[0] == 200
            assert c.send(1)[0] == 429
            sim.reset()
            assert sim.all_received() == []
            assert sim.stats().requests == 0
            assert c.send(1)[0] == 200
            assert sim.received(1)[0]["message_id"] == 1
        finally:
            c.close()


def test_presets() -> None:
    tg = SimulatorConfig.telegram()
    assert (tg.global_rate, tg.chat_rate, tg.group_rate) == (30.0, 1.0, 20.0)
    assert SimulatorConfig.telegram(chat_rate=5.0).chat_rate == 5.0
    assert SimulatorConfig.slack().chat_rate == 1.0


def test_the_telegram_preset_passes_the_stand_ins_telegram_limits() -> None:
    # On a fake clock: a group and a private chat sent to as fast as the
    # TELEGRAM preset allows never find the stand-in's Telegram buckets short.
    from outbound.ratelimit import TELEGRAM, RateLimiter  # noqa: PLC0415
    from outbound.simulator import _bucket  # noqa: PLC0415

    config = SimulatorConfig.telegram()
    now = [0.0]
    limiter = RateLimiter(TELEGRAM, clock=lambda: now[0])
    for chat in (-100, 7):
        buckets = [_bucket(config.chat_rate or 0.0, config.chat_burst, now[0])]
        if chat < 0:
            buckets.append(_bucket((config.group_rate or 0.0) / 60.0, config.group_burst, now[0]))
        for _ in range(40):
            wait = limiter.acquire(chat)
            while wait > 0.0:
                now[0] += wait
                wait = limiter.acquire(chat)
            assert all(b.wait(now[0], 0.0) == 0.0 for b in buckets)
            for b in buckets:
                b.tokens -= 1.0


@pytest.mark.parametrize(
    "changes",
    [
        {"chat_rate": 0},
        {"global_rate": -1.0},
        {"group_rate": float("inf")},
        {"error_rate": 1.5},
        {"latency": -0.1},
        {"error_status": 404},
        # (a burst below one message: every request a 429, for good)
        {"chat_burst": 0.5},
        {"global_burst": 0.999},
        # (a rate whose wait is infinite: each limited request's answer failed)
        {"chat_rate": 5e-324},
        {"global_rate": 1e-310},
        {"group_rate": 1e-320},
        {"group_rate": 1e-307},  # (per minute: its wait is 60 times as long)
        {"chat_rate": 1e-306},  # (its wait in milliseconds is infinite)
        {"chat_rate": 1e-305, "tolerance": 1e306},  # (with the tolerance)
    ],
)
def test_config_refuses_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SimulatorConfig(**changes)


def test_config_takes_a_huge_burst_of_a_sound_rate() -> None:
    # (Its longest wait is one message's: refused once as "would wait forever".)
    SimulatorConfig(global_rate=1.0, global_burst=1e306, chat_rate=0.01, chat_burst=1e306)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        # Each was taken: a bool as a number, a str as a bool (real_429s="no"
        # turned them on), a float status answered with a dropped connection.
        ({"latency": True}, TypeError),
        ({"error_rate": True}, TypeError),
        ({"error_status": 502.5}, TypeError),
        ({"max_text_length": 1.5}, TypeError),
        ({"real_429s": "no"}, TypeError),
        ({"whole_second_retry_after": 1}, TypeError),
        ({"seed": 1.5}, TypeError),
        ({"idle_timeout": True}, TypeError),
        ({"slow_delay": math.inf}, ValueError),
    ],
)
def test_config_refuses_values_of_the_wrong_type_by_name(
    changes: dict[str, Any], error: type[Exception]
) -> None:
    (name,) = changes
    with pytest.raises(error, match=name):
        SimulatorConfig(**changes)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"port": 70000}, ValueError),
        ({"port": -1}, ValueError),
        ({"port": True}, TypeError),
        ({"port": "8080"}, TypeError),
        ({"host": None}, TypeError),
        # (the bind raised a bare TypeError: "encoding of hostname failed")
        ({"host": "a..\u00e9"}, ValueError),
    ],
)
def test_the_simulator_refuses_an_address_it_cannot_bind_at_construction(
    options: dict[str, Any], error: type[Exception]
) -> None:
    # port=70000 was taken, and start() raised OverflowError.
    with pytest.raises(error, match=next(iter(options))):
        PlatformSimulator(**options)


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ({"kind": "error", "status": 502.5}, TypeError),
        ({"kind": "error", "status": True}, TypeError),
        ({"kind": "rate_limit", "retry_after": math.inf}, ValueError),
        ({"kind": "rate_limit", "retry_after": math.nan}, ValueError),
        ({"kind": "slow", "delay": math.inf}, ValueError),
        ({"kind": "slow", "delay": True}, TypeError),
    ],
)
def test_fault_refuses_what_it_could_not_answer(
    fault: dict[str, Any], error: type[Exception]
) -> None:
    # retry_after=inf was taken, then answered with "Infinity" (not JSON)
    # or a dropped connection.
    with pytest.raises(error):
        Fault(**fault)


@pytest.mark.parametrize("status", [509, 520, 599])
def test_an_error_fault_of_any_5xx_is_answered(
    sim: PlatformSimulator, client: Client, status: int
) -> None:
    # A status http.HTTPStatus does not name dropped the connection instead.
    sim.inject(Fault("error", status=status))
    answered, body = client.send(7)
    assert answered == status
    assert body["error_code"] == status


def test_error_status_of_any_5xx_is_answered() -> None:
    with PlatformSimulator(error_rate=1.0, error_status=520) as sim:
        client = Client(sim)
        try:
            assert client.send(7)[0] == 520
        finally:
            client.close()
        assert sim.stats().server_errors == 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"chat_id": "' + b"9" * 5000 + b'", "text": "x"}',  # past int()'s digits
        b'{"chat_id": ' + b"9" * 5000 + b', "text": "x"}',
        b"[" * 100_000 + b"]" * 100_000,  # past json's recursion
    ],
    ids=["long numeric str", "long number", "deep"],
)
def test_a_malformed_request_is_a_400_not_a_dropped_connection(client: Client, body: bytes) -> None:
    status, payload, _ = client.raw(
        "POST",
        f"/bot{client.sim.token}/sendMessage",
        body,
        {"Content-Type": "application/json"},
    )
    assert status == 400
    assert payload["ok"] is False


def test_wait_received_takes_a_timeout_past_timeout_max(
    sim: PlatformSimulator, client: Client
) -> None:
    client.send(3)
    assert sim.wait_received(1, timeout=math.inf) is True
    assert sim.wait_received(1, timeout=10**400) is True
    assert sim.wait_received(1, timeout=None) is True  # (no limit, as before)
    with pytest.raises(ValueError, match="timeout"):
        sim.wait_received(1, timeout=-1)


@pytest.mark.parametrize("idle", [math.inf, 1e10])
def test_an_idle_timeout_past_what_a_socket_takes_means_none(idle: float) -> None:
    # A socket refuses past threading.TIMEOUT_MAX: every connection was dropped.
    with PlatformSimulator(idle_timeout=idle) as sim:
        client = Client(sim)
        try:
            assert client.send(42, "hi")[0] == 200
            assert client.send(42, "again")[0] == 200  # on the same connection
        finally:
            client.close()
        assert texts(sim, 42) == ["hi", "again"]


def test_fault_refuses_bad_values() -> None:
    with pytest.raises(ValueError):
        Fault("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Fault("error", status=404)
    with pytest.raises(TypeError):
        PlatformSimulator().inject("drop")  # type: ignore[arg-type]


# ------------------------------------------------------------------ latency and faults


def test_latency_delays_every_answer() -> None:
    with PlatformSimulator(latency=0.1, jitter=0.05, seed=1) as sim:
        c = Client(sim)
        try:
            start = time.monotonic()
            assert c.send(1)[0] == 200
            elapsed = time.monotonic() - start
        finally:
            c.close()
    assert 0.1 <= elapsed < 1.0


def test_scheduled_error_hits_the_next_request_only(sim: PlatformSimulator, client: Client) -> None:
    sim.inject(Fault("error", status=503))
    status, payload = client.send(1, "lost")
    assert status == 503
    assert payload["ok"] is False
    assert client.send(1, "kept")[0] == 200
    assert texts(sim, 1) == ["kept"]
    assert sim.stats().server_errors == 1


def test_scheduled_fault_for_one_chat_skips_others(sim: PlatformSimulator, client: Client) -> None:
    sim.inject(Fault("rate_limit", chat_id=2, retry_after=3.0, scope="global"))
    assert client.send(1)[0] == 200
    status, payload = client.send(2)
    assert status == 429
    assert payload["parameters"] == {"retry_after": 3.0, "scope": "global"}
    assert client.send(2)[0] == 200
    assert sim.stats().global_limited == 1


def test_drop_closes_the_connection_without_answer(sim: PlatformSimulator, client: Client) -> None:
    sim.inject(Fault("drop"))
    with pytest.raises(http.client.RemoteDisconnected):
        client.send(1, "lost")
    client.close()
    assert client.send(1, "kept")[0] == 200
    assert texts(sim, 1) == ["kept"]
    assert sim.stats().dropped == 1


def test_slow_answer_is_delivered_but_late(sim: PlatformSimulator) -> None:
    sim.inject(Fault("slow", delay=5.0))
    c = Client(sim, timeout=0.2)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            c.send(1, "late")
    finally:
        c.close()
    assert time.monotonic() - start < 2.0
    assert texts(sim, 1) == ["late"]
    assert sim.stats().slow == 1


def test_random_faults_follow_their_probabilities() -> None:
    with PlatformSimulator(error_rate=1.0, error_status=500) as sim:
        c = Client(sim)
        try:
            assert [c.send(1)[0] for _ in range(3)] == [500, 500, 500]
        finally:
            c.close()
        assert sim.stats().server_errors == 3
    with PlatformSimulator(drop_rate=1.0) as sim:
        c = Client(sim)
        try:
            with pytest.raises(http.client.RemoteDisconnected):
                c.send(1)
        finally:
            c.close()


def test_seeded_faults_repeat() -> None:
    outcomes = []
    for _ in range(2):
        with PlatformSimulator(error_rate=0.5, seed=7) as sim:
            c = Client(sim)
            try:
                outcomes.append([c.send(1)[0] for _ in range(20)])
            finally:
                c.close()
    assert outcomes[0] == outcomes[1]
    assert 200 in outcomes[0]
    assert 502 in outcomes[0]


# ------------------------------------------------------------------ slack


def test_slack_post_message() -> None:
    with PlatformSimulator(chat_rate=1.0) as sim:
        c = Client(sim)
        auth = {"Authorization": f"Bearer {sim.token}", "Content-Type": "application/json"}
        try:
            body = json.dumps({"channel": "C01", "text": "hi"}).encode()
            status, payload, _ = c.raw("POST", "/api/chat.postMessage", body, auth)
            assert status == 200
            assert payload["ok"] is True
            assert payload["channel"] == "C01"
            assert payload["ts"]
            status, payload, headers = c.raw("POST", "/api/chat.postMessage", body, auth)
            assert status == 429
            assert payload["error"] == "ratelimited"
            assert headers["Retry-After"] == "1"
            assert payload["scope"] == "chat"
            empty = json.dumps({"channel": "C02"}).encode()
            assert c.raw("POST", "/api/chat.postMessage", empty, auth)[1]["error"] == "no_text"
            blocks = json.dumps({"channel": "C02", "blocks": [{"type": "divider"}]}).encode()
            assert c.raw("POST", "/api/chat.postMessage", blocks, auth)[1]["ok"] is True
            nochan = json.dumps({"text": "x"}).encode()
            payload = c.raw("POST", "/api/chat.postMessage", nochan, auth)[1]
            assert payload["error"] == "channel_not_found"
            status, payload, _ = c.raw("POST", "/api/chat.postMessage", body, {})
            assert (status, payload["error"]) == (200, "not_authed")
            form = urlencode({"token": sim.token, "channel": "C03", "text": "f"}).encode()
            ctype = {"Content-Type": "application/x-www-form-urlencoded"}
            assert c.raw("POST", "/api/chat.postMessage", form, ctype)[1]["ok"] is True
        finally:
            c.close()
        assert texts(sim, "C01") == ["hi"]
        assert sim.received("C01")[0]["platform"] == "slack"
        assert texts(sim, "C03") == ["f"]


# ------------------------------------------------------------------ lifecycle


def test_connections_are_kept_alive_and_counted(sim: PlatformSimulator, client: Client) -> None:
    for i in range(10):
        client.send(1, str(i))
    assert sim.stats().connections == 1
    assert sim.stats().open_connections == 1
    other = Client(sim)
    try:
        other.send(1)
    finally:
        other.close()
    assert sim.stats().connections == 2


def test_wait_received(sim: PlatformSimulator, client: Client) -> None:
    assert sim.wait_received(1, timeout=0.01) is False
    client.send(3)
    assert sim.wait_received(1, timeout=5) is True
    assert sim.wait_received(1, chat_id=3, timeout=5) is True
    assert sim.wait_received(1, chat_id=4, timeout=0.01) is False


def test_stop_ends_open_connections_and_slow_answers_promptly() -> None:
    sim = PlatformSimulator(slow_rate=1.0, slow_delay=30.0).start()
    idle = Client(sim)
    idle.conn.connect()
    busy = Client(sim, timeout=10)
    outcome: list[BaseException | int] = []

    def send() -> None:
        try:
            outcome.append(busy.send(1)[0])
        except BaseException as exc:
            outcome.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    assert sim.wait_received(1, timeout=5)
    start = time.monotonic()
    sim.stop()
    assert time.monotonic() - start < 3.0
    sender.join(5)
    assert not sender.is_alive()
    assert len(outcome) == 1
    idle.close()
    busy.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("outbound-simulator")]


@pytest.mark.parametrize("timeout", [math.inf, 1e300, 10**400, threading.TIMEOUT_MAX])
def test_stop_with_a_timeout_past_timeout_max_waits_and_closes_the_port(timeout: float) -> None:
    # Past threading.TIMEOUT_MAX is "as long as it takes": it raised
    # OverflowError half-way, the state already stopped, the port left open.
    sim = PlatformSimulator().start()
    port = urlsplit(sim.url).port
    assert port is not None
    client = Client(sim)
    client.send(1)
    sim.stop(timeout)
    client.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert not [t for t in threading.enumerate() if t.name.startswith("outbound-simulator")]


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1, ValueError), (math.nan, ValueError), ("5", TypeError), (True, TypeError)],
)
def test_stop_refuses_a_timeout_that_is_not_seconds_and_keeps_serving(
    timeout: object, error: type[Exception]
) -> None:
    sim = PlatformSimulator().start()
    try:
        with pytest.raises(error, match="timeout"):
            sim.stop(timeout)  # type: ignore[arg-type]
        client = Client(sim)
        assert client.send(1)[0] == 200
        client.close()
    finally:
        sim.stop()


def test_lifecycle_rules() -> None:
    sim = PlatformSimulator()
    with pytest.raises(RuntimeError):
        _ = sim.url
    assert "new" in repr(sim)
    sim.start()
    assert sim.start() is sim
    assert sim.url.startswith("http://127.0.0.1:")
    assert sim.token == DEFAULT_TOKEN
    sim.stop()
    sim.stop()
    assert "stopped" in repr(sim)
    with pytest.raises(RuntimeError):
        sim.start()
    PlatformSimulator().stop()


def test_custom_token() -> None:
    with PlatformSimulator(token="99:secret") as sim:
        c = Client(sim)
        try:
            assert c.send(1)[0] == 200
            assert (
                c.telegram("sendMessage", {"chat_id": 1, "text": "x"}, token=DEFAULT_TOKEN)[0]
                == 401
            )
        finally:
            c.close()
    with pytest.raises(ValueError):
        PlatformSimulator(token="a/b")


# ------------------------------------------------------------------ command line


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--chat-rate" in out
    assert "--drop-rate" in out


def test_subparser_builds_the_config() -> None:
    parser = argparse.ArgumentParser(prog="outbound")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["simulator", "--telegram-limits", "--chat-rate", "2", "--latency", "0.01", "--seed", "3"]
    )
    assert args.func is run
    config = config_from_args(args)
    assert (config.global_rate, config.chat_rate, config.group_rate) == (30.0, 2.0, 20.0)
    assert (config.latency, config.seed) == (0.01, 3)
    assert not config.real_429s
    args = parser.parse_args(["simulator", "--slack-limits", "--real-429s"])
    assert config_from_args(args).real_429s


def test_bad_option_value_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--chat-rate", "-1"]) == 2
    assert "chat_rate" in capsys.readouterr().err


def test_command_line_serves_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbound.simulator", "--port", "0", "--chat-rate", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        assert ready, "the simulator printed no URL"
        url = proc.stdout.readline().strip()
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=5)
        try:
            body = json.dumps({"chat_id": 1, "text": "x"}).encode()
            conn.request("POST", f"/bot{DEFAULT_TOKEN}/sendMessage", body)
            assert conn.getresponse().status == 200
        finally:
            conn.close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=5)
    assert proc.returncode == 0, err
    assert "1 delivered" in out


def test_an_empty_host_serves_every_interface() -> None:
    with PlatformSimulator(host="") as sim:
        client = Client(sim)
        try:
            assert client.send(5)[0] == 200
        finally:
            client.close()


def test_command_line_stop_after_its_reader_went_away_is_still_the_normal_end() -> None:
    # A script read the URL and closed the pipe: the stop printed
    # "error: [Errno 32] Broken pipe" and ended with status 1.
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbound", "simulator", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        assert ready, "the simulator printed no URL"
        assert proc.stdout.readline().startswith(b"http://")
        proc.stdout.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=5)
    assert proc.returncode == 0, err
    assert err == b""


def test_command_line_names_the_address_it_cannot_listen_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"simulator: cannot listen on 127.0.0.1:{port}: "), err
    assert main(["--host", "no-such-host.invalid", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("simulator: cannot listen on no-such-host.invalid:0: "), err
