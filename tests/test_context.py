"""TaskContext.state across Defer re-runs, and narrow_deadline inside and outside tasks."""

from __future__ import annotations

import time

import pytest

from outbound import Defer, Dispatcher, current_context, narrow_deadline

WAIT = 10.0


def test_state_survives_defer_and_is_per_task() -> None:
    seen: list[tuple[int, int]] = []

    def task() -> int:
        ctx = current_context()
        runs: int = ctx.state.get("runs", 0) + 1
        ctx.state["runs"] = runs
        seen.append((ctx.attempt, runs))
        if runs < 3:
            raise Defer(0.001)
        return runs

    with Dispatcher(max_inflight=2) as d:
        assert d.submit("a", task).result(WAIT) == 3
        assert d.submit("a", task).result(WAIT) == 3  # a new task: fresh state
    assert seen == [(1, 1), (2, 2), (3, 3)] * 2


def test_narrow_deadline_inside_a_task_keeps_the_task() -> None:
    def task() -> tuple[bool, bool, bool]:
        outer = current_context()
        outer.state["x"] = 1
        soon = time.monotonic() + 0.5
        with narrow_deadline(soon) as inner:
            same = current_context() is inner
            narrowed = inner.deadline == soon and inner.key == outer.key
            shared = inner.state is outer.state
        return same and current_context() is outer, narrowed, shared

    with Dispatcher(max_inflight=1, send_timeout=30.0) as d:
        assert d.submit("k", task).result(WAIT) == (True, True, True)


def test_narrow_deadline_never_extends_the_task_deadline() -> None:
    def task() -> bool:
        outer = current_context()
        with narrow_deadline(outer.deadline + 100) as inner:
            return inner.deadline == outer.deadline

    with Dispatcher(max_inflight=1, send_timeout=1.0) as d:
        assert d.submit("k", task).result(WAIT)


def test_narrow_deadline_outside_a_task() -> None:
    with pytest.raises(RuntimeError):
        current_context()
    deadline = time.monotonic() + 2.0
    with narrow_deadline(deadline) as ctx:
        assert current_context() is ctx
        assert ctx.key is None
        assert not ctx.cancelled
        assert 0.0 < ctx.remaining() <= 2.0
    with pytest.raises(RuntimeError):
        current_context()


def test_the_repr_of_a_context_and_of_dispatch_info_with_any_key() -> None:
    """Any hashable object is a key: a task logging its context (or a hook its
    DispatchInfo) with %r failed for a key of 5,000 digits (str() of an int
    refuses past 4,300) or one whose repr raises."""
    from outbound import Dispatcher, current_context  # noqa: PLC0415
    from outbound.hooks import DispatchInfo, Hooks  # noqa: PLC0415

    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    infos: list[DispatchInfo] = []
    with Dispatcher(hooks=Hooks(on_done=infos.append)) as d:
        for key in (10**5000, BadRepr(), "k"):
            shown = d.submit(key, lambda: repr(current_context())).result(10)
            assert shown.startswith("<TaskContext key=")
    assert len(infos) == 3
    texts = [repr(info) for info in infos]
    assert all(text.startswith("DispatchInfo(key=") for text in texts)
    assert any(text.startswith("DispatchInfo(key='k', queue_len=0, ") for text in texts)


def test_a_handler_bound_to_a_lease_begins_no_io_past_it_and_keeps_its_deadline() -> None:
    """A relay's handler: time_allowed() refuses once the lease (which renewals move
    later) has passed, also inside a narrowed deadline (a copy of the context),
    and otherwise gives the task's own time, not the lease's: a send begun in
    time with a socket timeout cut to the lease failed, and went out again."""
    from outbound import Dispatcher, current_context  # noqa: PLC0415
    from outbound.context import (  # noqa: PLC0415
        _bind_to_lease,
        _restore_context,
        narrow_deadline,
        time_allowed,
    )
    from outbound.errors import SendTimeout  # noqa: PLC0415

    class Leased:
        lease_until = time.monotonic() + 1.5
        returned = False
        released = False

    def task() -> None:
        start = current_context().deadline
        leased = Leased()
        previous = _bind_to_lease(leased, 1.0)
        try:
            assert current_context().deadline == start  # (the task's own)
            assert time_allowed(10.0) > 900.0  # (not the lease's half second)
            with narrow_deadline(time.monotonic() + 100.0):
                leased.lease_until = time.monotonic() + 1000.0  # renewed: later
                assert 90.0 < time_allowed(10.0) <= 100.0
                leased.lease_until = time.monotonic()  # not renewed since: passed
                with pytest.raises(SendTimeout, match="lease"):
                    time_allowed(10.0)
            with pytest.raises(SendTimeout, match="lease"):
                time_allowed(10.0)
        finally:
            _restore_context(previous)
        assert time_allowed(10.0) > 900.0  # (restored)

    with Dispatcher(send_timeout=1000.0) as d:
        d.submit("k", task).result(10)
    previous = _bind_to_lease(Leased(), 1e9)  # outside a task: nothing changes
    assert previous is None
    assert time_allowed(7.0) == 7.0


def test_a_lease_fence_holds_in_tasks_only_not_in_a_context_copied_for_other_work() -> None:
    """A context copied inside a handler carries its fence (a dispatcher made there
    copies one for its initializer): outside a task, time_allowed() is the
    default there, as anywhere outside a task; it refused, and a dispatcher
    made on first use in a handler whose row was let go broke for good."""
    import contextvars  # noqa: PLC0415
    import math  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from outbound import Dispatcher  # noqa: PLC0415
    from outbound.context import _bind_to_lease, _restore_context, time_allowed  # noqa: PLC0415
    from outbound.errors import SendTimeout  # noqa: PLC0415

    class Leased:
        lease_until = math.inf
        returned = False
        released = True  # (the row let go: no send begins for it)

    copied: list[contextvars.Context] = []

    def handler() -> None:
        token = _bind_to_lease(Leased(), 1.0)
        try:
            with pytest.raises(SendTimeout, match="lease"):
                time_allowed(10.0)
            copied.append(contextvars.copy_context())
        finally:
            _restore_context(token)

    with Dispatcher() as d:
        d.submit("k", handler).result(10)
    outside: list[float] = []
    thread = threading.Thread(target=lambda: outside.append(copied[0].run(time_allowed, 7.0)))
    thread.start()
    thread.join(10)
    assert outside == [7.0]
    ran: list[float] = []
    made = copied[0].run(Dispatcher, initializer=lambda: ran.append(time_allowed(7.0)))
    with made:  # (made in that context: its initializer's is a copy of it)
        made.submit("k", lambda: None).result(10)
    assert ran == [7.0]
