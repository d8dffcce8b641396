"""gunicorn settings for the example bot: ``gunicorn -c gunicorn.conf.py 'app:create_app()'``.

``--preload`` imports the app once in the master: outbound starts nothing
there, and each worker builds its own dispatcher on its first reply.
"""

from __future__ import annotations

from typing import Any

bind = "127.0.0.1:8000"
workers = 2
worker_class = "gthread"
threads = 4
preload_app = True
# Seconds a stopping worker gets before the master kills it. The worker
# first finishes its requests, then worker_exit below sends what it queued
# within three quarters of this, leaving room for those requests.
graceful_timeout = 30


def post_fork(server: Any, worker: Any) -> None:
    """Nothing to rebuild: outbound checks the pid and starts afresh in the worker."""
    worker.log.debug("worker %s: outbound starts its dispatcher on first use", worker.pid)


def worker_exit(server: Any, worker: Any) -> None:
    """Send what this worker accepted before it exits, within a bound."""
    from outbound.contrib.flask import shutdown_all  # noqa: PLC0415 - only in workers

    timeout = 0.75 * worker.cfg.graceful_timeout
    if not shutdown_all(timeout=timeout):
        worker.log.warning("outbound: queued replies left unsent after %.1f s", timeout)
