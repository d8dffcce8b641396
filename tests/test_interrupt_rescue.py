"""A Ctrl-C in ``submit`` (its ``on_queued`` hook) for a new key takes the task
back, while workers take lanes from the ready queue: the take-back looked for
the lane in that queue by iterating it, and a worker's take meanwhile (workers
take without the dispatcher's lock) raised ``RuntimeError('deque mutated
during iteration')`` out of it: the caller got that instead of the Ctrl-C, and
the task it refused ran anyway."""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

from outbound import Dispatcher, Hooks
from outbound.dispatcher import Dispatcher as _Dispatcher


def test_a_worker_taking_a_lane_while_submit_takes_its_task_back() -> None:
    gate = threading.Event()
    first_started = threading.Event()
    release = threading.Event()
    ran = threading.Event()
    armed = [False]
    seen: list[bool] = []

    def on_queued(key: object, queue_len: int) -> None:
        if armed[0] and key == "new":
            armed[0] = False
            raise KeyboardInterrupt  # a Ctrl-C landing in on_queued

    rescue = _Dispatcher._rescue.__code__

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        # As the take-back begins to look through the ready queue: a worker
        # takes the first lane from it (the one it was busy for, let go).
        if (
            event == "call"
            and not seen
            and frame.f_back is not None
            and frame.f_back.f_code is rescue
        ):
            gate.set()
            seen.append(first_started.wait(10))

    dispatcher = Dispatcher(max_inflight=1, hooks=Hooks(on_queued=on_queued))
    try:
        dispatcher.submit("busy", gate.wait, 10)

        def first() -> None:  # (holds the one worker until submit returned)
            first_started.set()
            release.wait(10)

        dispatcher.submit("first", first)
        for i in range(10):
            dispatcher.submit(i, int)
        armed[0] = True
        raised: BaseException | None = None
        sys.setprofile(profile)
        try:
            dispatcher.submit("new", ran.set)
        except BaseException as exc:
            raised = exc
        finally:
            sys.setprofile(None)
        gate.set()
        release.set()
        assert seen == [True], "the take-back never looked through the ready queue"
        assert dispatcher.drain(10)
        assert isinstance(raised, KeyboardInterrupt), repr(raised)
        assert not ran.is_set(), "the task whose submit raised ran anyway"
    finally:
        gate.set()
        release.set()
        dispatcher.force_close()
        assert dispatcher.shutdown(10)
