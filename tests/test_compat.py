"""The interpreter internals the core relies on (outbound/_compat.py) are as expected.

These fail loudly on a Python whose internals moved: then update _compat.py
after checking the new layout. At run time the library falls back instead
(a plain Future, plain atexit), which the last tests check.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future

from outbound import _compat, _future


def test_future_layout_is_the_one_relied_on() -> None:
    assert _compat.future_layout_problem() is None
    assert set(vars(Future())) == _compat.FUTURE_FIELDS


def test_lazy_futures_are_in_use() -> None:
    assert _future.LAZY is True
    assert _future._self_test() is None


def test_register_before_thread_join_is_available() -> None:
    assert callable(getattr(threading, "_register_atexit", None))


def test_threading_says_when_its_exit_has_begun() -> None:
    assert getattr(threading, "_SHUTTING_DOWN", None) is False
    assert _compat.interpreter_exiting() is False


def test_timeout_max_is_the_threading_one() -> None:
    assert threading.TIMEOUT_MAX == _compat.TIMEOUT_MAX
    assert threading.Lock().acquire(timeout=_compat.TIMEOUT_MAX)


def test_a_changed_future_layout_falls_back_to_plain_futures() -> None:
    """A Future with another field: warning at import, plain Futures, dispatcher works."""
    script = textwrap.dedent(
        """
        import warnings
        import concurrent.futures as cf
        original = cf.Future.__init__
        def changed(self):
            original(self)
            self._new_field = None
        cf.Future.__init__ = changed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import outbound
            from outbound import _future
        assert not _future.LAZY
        assert any("falling back to plain Futures" in str(w.message) for w in caught), caught
        with outbound.Dispatcher() as d:
            f = d.submit("k", lambda: 41 + 1)
            assert type(f) is cf.Future, type(f)
            assert f.result(timeout=10) == 42
        print("fallback ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout


def test_missing_register_atexit_falls_back_to_atexit() -> None:
    script = textwrap.dedent(
        """
        import threading
        import concurrent.futures.thread  # needs it at import, as outbound.errors does
        del threading._register_atexit
        from outbound import Dispatcher
        d = Dispatcher(exit_timeout=5)
        d.submit("k", print, "ran at exit or before", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "ran at exit or before" in proc.stdout
