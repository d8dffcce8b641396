"""Locks a forked child can take: each registered one is made new (unlocked) in it;
and the lazily imported module a connect needs, imported before any thread runs.

A lock held by another thread at ``os.fork()`` stays held for good in the
child, where that thread does not exist: a child that sends through a rate
limiter or a metrics middleware the parent was using at that instant would
wait for it forever (gunicorn ``--preload`` forks a parent that may be
sending). What the lock guards is left as it was; the objects that hold
such locks keep plain dicts and numbers, each change of which is whole.
Thread-safe; nothing here blocks.
"""

from __future__ import annotations

# Imported here, before any thread of ours runs, so that no fork can land
# inside its import: socket.getaddrinfo imports this codec on the first
# connect to a host name (a sender's, a Redis limiter's). A fork during that
# import (gunicorn --preload, a parent sending) left the module's import lock
# held in the child for good, and every connect there waited on it.
import encodings.idna  # noqa: F401
import os
import threading
import weakref
from typing import Any, TypeVar

__all__ = ["forks", "renewed_after_fork"]


L = TypeVar("L")

# Every registered lock (a weak set: a lock goes with its owner).
_locks: weakref.WeakSet[Any] = weakref.WeakSet()
_guard = threading.Lock()


def renewed_after_fork(lock: L) -> L:
    """Register ``lock`` (a ``threading`` lock or condition, or anything with an
    ``_at_fork_reinit()`` method) to be made new in a forked child; return it."""
    with _guard:
        _locks.add(lock)
    return lock


#: How many forks this process is away from the first: a thread that began
#: before the last fork (the one that forked) can tell by its own copy.
#: Written only in a forked child, before any other thread exists there.
forks = 0


def _in_child() -> None:
    global _guard, forks
    _guard = threading.Lock()
    forks += 1
    for lock in list(_locks):
        lock._at_fork_reinit()  # threading's own, as logging uses it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
