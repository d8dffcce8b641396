"""The public front: ``outbound.__all__`` and the error tree."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import pathlib
import subprocess
import sys
from concurrent.futures.thread import BrokenThreadPool

import pytest

import outbound
from outbound import errors

# Modules whose public names are re-exported by `outbound` itself. The other
# layers are namespaces of their own (`outbound.middleware`, `outbound.outbox`,
# ...); add a module here when `outbound/__init__.py` starts re-exporting it.
CORE_MODULES = ["context", "dispatcher", "errors", "executor", "hooks", "messages", "reply"]

# Public-looking helpers of core modules that are deliberately not API.
NOT_API = {"outbound.hooks.call_hook"}


def test_all_is_sorted_and_unique() -> None:
    assert outbound.__all__ == sorted(outbound.__all__)
    assert len(set(outbound.__all__)) == len(outbound.__all__)


def test_everything_in_all_exists() -> None:
    missing = [name for name in outbound.__all__ if not hasattr(outbound, name)]
    assert missing == []


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from outbound import *", namespace)
    namespace.pop("__builtins__")
    assert sorted(namespace) == sorted(outbound.__all__)


@pytest.mark.parametrize("module_name", CORE_MODULES)
def test_core_module_names_are_exported(module_name: str) -> None:
    """Every name in a core module's __all__ is re-exported as the same object."""
    module = importlib.import_module(f"outbound.{module_name}")
    missing = [name for name in module.__all__ if name not in outbound.__all__]
    assert missing == [], f"outbound.{module_name} names missing from outbound.__all__"
    for name in module.__all__:
        assert getattr(outbound, name) is getattr(module, name)


@pytest.mark.parametrize("module_name", CORE_MODULES)
def test_core_module_all_lists_its_public_definitions(module_name: str) -> None:
    """A public class or function defined in a core module is in its __all__."""
    module = importlib.import_module(f"outbound.{module_name}")
    assert module.__all__ == sorted(module.__all__)
    defined = [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == module.__name__
        and f"{module.__name__}.{name}" not in NOT_API
    ]
    assert sorted(set(defined) - set(module.__all__)) == []
    assert all(hasattr(module, name) for name in module.__all__)


def test_version() -> None:
    assert isinstance(outbound.__version__, str)
    assert outbound.__version__ == importlib.metadata.version("outbound-dispatcher")


def test_py_typed_shipped() -> None:
    assert (pathlib.Path(outbound.__file__).parent / "py.typed").is_file()


def test_library_logger_has_null_handler() -> None:
    handlers = logging.getLogger("outbound").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_import_starts_no_thread() -> None:
    code = "import threading, outbound; print(threading.active_count())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "1"


# ----------------------------------------------------------------- errors


def test_error_tree() -> None:
    assert issubclass(errors.OutboundError, Exception)
    assert issubclass(errors.QueueFull, errors.OutboundError)
    assert issubclass(errors.DispatcherClosed, errors.OutboundError)
    assert issubclass(errors.DispatcherClosed, RuntimeError)
    assert issubclass(errors.BrokenDispatcher, BrokenThreadPool)
    assert issubclass(errors.BrokenDispatcher, errors.DispatcherClosed)
    assert not issubclass(errors.QueueFull, RuntimeError)


def test_every_error_derives_from_outbound_error() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.OutboundError), name


def test_error_tree_drawn_in_docstring() -> None:
    doc = errors.__doc__ or ""
    missing = [name for name in errors.__all__ if name not in doc]
    assert missing == []


def test_errors_are_caught_as_builtins() -> None:
    with pytest.raises(RuntimeError):
        raise outbound.DispatcherClosed("closed")
    with pytest.raises(outbound.OutboundError):
        raise outbound.QueueFull("k", 3)
    with pytest.raises(BrokenThreadPool):
        raise outbound.BrokenDispatcher("broken")


def test_queue_full_carries_key_and_size() -> None:
    exc = outbound.QueueFull(("chat", 1), 64)
    assert exc.key == ("chat", 1)
    assert exc.queue_size == 64
    assert "64" in str(exc)
