"""Outbound.reply / reply_text: futures that never raise, lanes per chat."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future

import pytest

from outbound import Dispatcher, DispatcherClosed, QueueFull
from outbound.messages import MethodMessage, SendRequest, SendResult, TextMessage
from outbound.reply import Outbound

WAIT = 10.0


class RecordingSender:
    """Records requests in order; optionally blocks until ``gate`` is set."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.lock = threading.Lock()
        self.requests: list[SendRequest] = []
        self.gate = gate
        self.started = threading.Event()

    def send(self, request: SendRequest) -> SendResult:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        with self.lock:
            self.requests.append(request)
            return SendResult(len(self.requests), {"ok": True})

    def validate(self, request: SendRequest) -> None:
        message = request.message
        if isinstance(message, TextMessage) and len(message.text) > 10:
            raise ValueError("text too long")
        if isinstance(message, MethodMessage) and message.method == "boom":
            raise RuntimeError("validator bug")


def test_reply_returns_the_send_result() -> None:
    sender = RecordingSender()
    with Dispatcher() as d:
        out = Outbound(d, sender)
        result = out.reply(7, TextMessage("hi"), idempotency_key="k1").result(WAIT)
        text = out.reply_text(
            7, "there", parse_mode="HTML", disable_notification=True, idempotency_key="k2"
        ).result(WAIT)
    assert (result.message_id, text.message_id) == (1, 2)
    first, second = sender.requests
    assert first == SendRequest(7, TextMessage("hi"), "k1")
    assert second == SendRequest(7, TextMessage("there", "HTML", True), "k2")
    assert out.dispatcher is d
    assert out.sender is sender
    assert "Outbound" in repr(out)


@pytest.mark.parametrize(
    ("chat_id", "message", "error"),
    [
        (1.5, TextMessage("x"), TypeError),
        (None, TextMessage("x"), TypeError),
        (True, TextMessage("x"), TypeError),
        ([1], TextMessage("x"), TypeError),
        ("", TextMessage("x"), ValueError),
        (1, "not a message", TypeError),
        (1, TextMessage("much too long here"), ValueError),
        (1, MethodMessage("boom"), RuntimeError),
    ],
)
def test_bad_input_comes_back_in_the_future(
    chat_id: object, message: object, error: type[BaseException]
) -> None:
    sender = RecordingSender()
    with Dispatcher() as d:
        future = Outbound(d, sender).reply(chat_id, message)  # type: ignore[arg-type]
        assert future.done()
        assert isinstance(future.exception(0), error)
        assert d.stats().lanes == 0
    assert sender.requests == []


@pytest.mark.parametrize("text", ["", "   ", None, 42])
def test_bad_text_comes_back_in_the_future(text: object) -> None:
    sender = RecordingSender()
    with Dispatcher() as d:
        future = Outbound(d, sender).reply_text(1, text)  # type: ignore[arg-type]
        assert future.done()
        assert isinstance(future.exception(0), (TypeError, ValueError))
    assert sender.requests == []


@pytest.mark.parametrize(
    "options",
    [{"parse_mode": object()}, {"parse_mode": 1}, {"disable_notification": "yes"}],
)
def test_bad_text_options_come_back_in_the_future(options: dict[str, object]) -> None:
    """They failed inside the task (json.dumps), after the message was queued."""
    sender = RecordingSender()
    with Dispatcher() as d:
        future = Outbound(d, sender).reply_text(1, "hi", **options)  # type: ignore[arg-type]
        assert future.done()
        assert isinstance(future.exception(0), TypeError)
        assert d.stats().lanes == 0
    assert sender.requests == []


@pytest.mark.parametrize("raised", [SystemExit, GeneratorExit, RuntimeError])
def test_a_done_callback_on_a_refused_reply_is_logged_not_raised(
    raised: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    """As on an accepted reply's future: a refused one's callback runs at once, in the
    caller's thread, and what it raises is logged (SystemExit went up to the caller)."""
    ran: list[str] = []

    def callback(future: Future[SendResult]) -> None:
        ran.append("first")
        raise raised("from the callback")

    sender = RecordingSender()
    with Dispatcher() as d:
        out = Outbound(d, sender)
        refused = [out.reply_text(1, ""), out.reply(True, TextMessage("x"))]
        out.close()
        refused.append(out.reply_text(1, "after close"))
        for future in refused:
            future.add_done_callback(callback)
            future.add_done_callback(lambda f: ran.append("second"))
    assert ran == ["first", "second"] * 3
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info and r.exc_info[1] is not None]
    assert [type(e) for e in logged] == [raised] * 3


def test_queue_full_and_closed_come_back_in_the_future() -> None:
    gate = threading.Event()
    sender = RecordingSender(gate)
    with Dispatcher(queue_size=1) as d:
        out = Outbound(d, sender)
        running = out.reply_text(1, "a")
        assert sender.started.wait(WAIT)
        queued = out.reply_text(1, "b")
        refused = out.reply_text(1, "c")
        assert refused.done()
        assert isinstance(refused.exception(0), QueueFull)
        other_chat = out.reply_text(2, "d")  # only the full chat is refused
        gate.set()
        for f in (running, queued, other_chat):
            f.result(WAIT)
        d.close()
        closed = out.reply_text(1, "e")
        assert isinstance(closed.exception(0), DispatcherClosed)
    assert [r.message.text for r in sender.requests if r.chat_id == 1] == ["a", "b"]  # type: ignore[union-attr]


def test_the_send_goes_on_after_the_handler_returns() -> None:
    gate = threading.Event()
    sender = RecordingSender(gate)
    futures: list[Future[SendResult]] = []
    with Dispatcher() as d:
        out = Outbound(d, sender)

        def handler() -> None:
            futures.append(out.reply_text(5, "bye"))

        t = threading.Thread(target=handler)
        t.start()
        t.join(WAIT)
        assert not t.is_alive()
        assert not futures[0].done()
        gate.set()
        assert futures[0].result(WAIT).message_id == 1


def test_per_chat_order_under_concurrent_callers() -> None:
    sender = RecordingSender()
    chats, per_thread, threads_n = 5, 40, 6
    with Dispatcher(max_inflight=4) as d:
        out = Outbound(d, sender)
        barrier = threading.Barrier(threads_n)
        futures: list[Future[SendResult]] = []
        lock = threading.Lock()

        def caller(n: int) -> None:
            barrier.wait(WAIT)
            mine = [out.reply_text(i % chats, f"{n}:{i}") for i in range(per_thread)]
            with lock:
                futures.extend(mine)

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        for f in futures:
            f.result(WAIT)
    assert len(sender.requests) == per_thread * threads_n
    for chat in range(chats):
        seen: dict[str, int] = {}
        for r in sender.requests:
            if r.chat_id != chat:
                continue
            n, i = r.message.text.split(":")  # type: ignore[union-attr]
            assert int(i) > seen.get(n, -1)  # each caller's messages in its order
            seen[n] = int(i)


def test_force_close_resolves_every_future() -> None:
    gate = threading.Event()
    sender = RecordingSender(gate)
    d = Dispatcher(max_inflight=1)
    out = Outbound(d, sender)
    futures = [out.reply_text(i % 3, "x") for i in range(9)]
    assert sender.started.wait(WAIT)
    d.force_close()
    gate.set()
    assert d.shutdown(WAIT)
    outcomes = [f.exception(WAIT) if not f.cancelled() else CancelledError() for f in futures]
    assert outcomes[0] is None
    assert all(isinstance(e, CancelledError) for e in outcomes[1:])


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(TypeError):
        Outbound(object(), RecordingSender())  # type: ignore[arg-type]
    with Dispatcher() as d, pytest.raises(TypeError):
        Outbound(d, object())  # type: ignore[arg-type]


# ------------------------------------------------------------------ closing


def test_an_outbound_closes_the_dispatcher_it_made() -> None:
    gate = threading.Event()
    sender = RecordingSender(gate)
    with Outbound(None, sender, max_inflight=2, queue_size=8) as out:
        assert out.dispatcher.max_inflight == 2
        futures = [out.reply_text(1, f"m{i}") for i in range(3)]
        gate.set()
    # Leaving the block shut the made dispatcher down: what was accepted went out.
    assert [f.result(0).message_id for f in futures] == [1, 2, 3]
    assert out.closed
    assert out.dispatcher.state.value == "closed"
    refused = out.reply_text(1, "late")
    assert isinstance(refused.exception(0), DispatcherClosed)
    assert out.close() is True  # idempotent


def test_an_outbound_leaves_a_given_dispatcher_running() -> None:
    sender = RecordingSender()
    with Dispatcher() as d:
        out = Outbound(d, sender)
        assert out.close(timeout=0) is True
        assert isinstance(out.reply_text(1, "x").exception(0), DispatcherClosed)
        assert d.submit("k", lambda: 42).result(WAIT) == 42  # still the owner's to use
        with pytest.raises(TypeError):
            Outbound(d, sender, max_inflight=3)


def test_closing_a_made_dispatcher_honours_the_timeout() -> None:
    gate = threading.Event()
    sender = RecordingSender(gate)
    out = Outbound(None, sender)
    future = out.reply_text(1, "held")
    assert sender.started.wait(WAIT)
    assert out.close(timeout=0.05) is False  # the send is still held
    gate.set()
    assert future.result(WAIT).message_id == 1
    assert out.close(timeout=WAIT) is True


def test_closing_a_made_dispatcher_with_every_send_done_is_true_at_a_timeout_of_0() -> None:
    out = Outbound(None, RecordingSender())
    futures = [out.reply_text(chat, "x") for chat in range(4)]
    assert sorted(int(f.result(WAIT).message_id or 0) for f in futures) == [1, 2, 3, 4]
    assert out.dispatcher.stats().threads > 0  # idle threads, yet to leave
    assert out.close(timeout=0) is True


def test_close_from_a_done_callback_closes_both_and_a_later_close_waits() -> None:
    gate = threading.Event()
    sender = RecordingSender(gate)
    out = Outbound(None, sender)
    seen: list[object] = []
    called = threading.Event()

    def close_from_callback(future: Future[SendResult]) -> None:
        try:
            seen.append(out.close(timeout=1.0))
        except BaseException as error:  # pragma: no cover - the defect
            seen.append(error)
        called.set()

    first = out.reply_text(1, "first")
    first.add_done_callback(close_from_callback)  # runs in a worker, once it is sent
    gate.set()
    assert called.wait(WAIT)
    assert seen == [False]  # it cannot wait for its own dispatcher: it says so
    assert out.closed
    assert isinstance(out.reply_text(1, "late").exception(0), DispatcherClosed)
    with pytest.raises(DispatcherClosed):
        out.dispatcher.submit(1, lambda: None)  # not half-closed: the dispatcher too
    assert out.close(timeout=WAIT) is True  # from here, it waits and ends
    assert out.dispatcher.state.value == "closed"


def test_a_bad_close_timeout_changes_nothing() -> None:
    with Outbound(None, RecordingSender()) as out:
        with pytest.raises(ValueError, match="timeout"):
            out.close(timeout=-1)
        assert not out.closed
        assert out.reply_text(1, "still open").result(WAIT).message_id == 1


def test_outbounds_on_one_dispatcher_have_lanes_of_their_own() -> None:
    gate = threading.Event()
    held, free = RecordingSender(gate), RecordingSender()
    with Dispatcher() as d:
        first, second = Outbound(d, held), Outbound(d, free)
        assert first.lane_key(7) == 7  # the first keeps plain chat ids (hooks see them)
        assert second.lane_key(7) == (second, 7)
        blocked = first.reply_text(7, "held")
        assert held.started.wait(WAIT)
        # The same chat id of another Outbound is not queued behind it.
        assert second.reply_text(7, "free").result(WAIT).message_id == 1
        assert not blocked.done()
        gate.set()
        assert blocked.result(WAIT).message_id == 1
    with Outbound(None, free) as own:
        assert own.lane_key(7) == 7


class _ValidateRaises(RecordingSender):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def validate(self, request: SendRequest) -> None:
        raise self.error


@pytest.mark.parametrize("error", [SystemExit("bad"), GeneratorExit(), KeyboardInterrupt()])
def test_whatever_validate_raises_comes_back_in_the_future(error: BaseException) -> None:
    """reply() "never raises": a validate raising SystemExit (or GeneratorExit) came out
    of it, in a web handler. (A Ctrl-C raised in a thread other than the main one
    is no interruption: it comes back too.)"""
    sender = _ValidateRaises(error)
    _assert_comes_back_in_the_future(sender, "hi", error)
    assert sender.requests == []


def _assert_comes_back_in_the_future(
    sender: RecordingSender, text: str, error: BaseException
) -> None:
    """reply_text(1, ``text``) in a thread of its own (a Ctrl-C there is no
    interruption) returns a future failed with ``error``, and queues nothing."""
    outcome: list[Future[SendResult] | BaseException] = []

    def reply() -> None:
        try:
            outcome.append(Outbound(d, sender).reply_text(1, text))
        except BaseException as exc:
            outcome.append(exc)

    with Dispatcher() as d:
        caller = threading.Thread(target=reply)
        caller.start()
        caller.join(WAIT)
        assert len(outcome) == 1
        future = outcome[0]
        assert isinstance(future, Future), future
        assert future.exception(0) is error
        assert d.stats().lanes == 0


class _StripRaises(str):
    """A text whose strip() (TextMessage checks it) raises ``error``."""

    error: BaseException = SystemExit("bad")

    def strip(self, chars: str | None = None) -> str:
        raise self.error


@pytest.mark.parametrize("error", [SystemExit("bad"), GeneratorExit(), KeyboardInterrupt()])
def test_whatever_checking_the_text_raises_comes_back_in_the_future(
    error: BaseException,
) -> None:
    """reply_text() "never raises" either: checking the text caught Exception only."""
    sender = RecordingSender()
    text = _StripRaises("hi")
    text.error = error
    _assert_comes_back_in_the_future(sender, text, error)
    assert sender.requests == []


def test_a_later_outbounds_refusal_names_the_chat_and_reads_no_stats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A later Outbound's lanes are (outbound, chat_id): its QueueFull quoted the
    Outbound's repr, which read the dispatcher's stats (its lock held while every
    lane was walked, at each refusal), and the chat id could fall past the 200
    characters the message keeps of a key."""
    release = threading.Event()

    class Held:
        def send(self, request: SendRequest) -> SendResult:
            release.wait(WAIT)
            return SendResult(message_id=1)

    d = Dispatcher(max_inflight=1, queue_size=1)
    first, later = Outbound(d, Held()), Outbound(d, Held())
    try:
        first.reply_text(1, "runs")  # (the one thread, held)
        later.reply_text(987654321, "queued")  # the lane full
        reads: list[int] = []
        monkeypatch.setattr(Dispatcher, "stats", lambda self: reads.append(1))
        refused = later.reply_text(987654321, "refused").exception(0)
        assert isinstance(refused, QueueFull)
        assert "987654321" in str(refused)
        assert reads == []
        assert repr(later).startswith("<Outbound sender=Held ")
        assert reads == []
    finally:
        monkeypatch.undo()
        release.set()
        assert d.shutdown(WAIT)


def test_a_ctrl_c_in_validate_in_the_main_thread_is_raised() -> None:
    sender = _ValidateRaises(KeyboardInterrupt())
    with Dispatcher() as d, pytest.raises(KeyboardInterrupt):
        Outbound(d, sender).reply_text(1, "hi")
    assert sender.requests == []
