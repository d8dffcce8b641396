"""An HTTP server with a thread per connection that it can end and join.

Used by the platform stand-in (:mod:`outbound.simulator`) and the outbox's
status page (:mod:`outbound.outbox.web`): both must stop with no thread
left behind, also while a client keeps a connection open.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from typing import Any

__all__ = ["ConnectionThreadsServer"]


class ConnectionThreadsServer(http.server.HTTPServer):
    """One daemon thread per connection (named :attr:`thread_name`), each tracked.

    :meth:`close_connections` shuts down the sockets being served, so that
    their threads end; :meth:`join_threads` waits for those threads until a
    deadline. Thread-safe; neither blocks beyond what it says.
    """

    thread_name = "outbound-http-conn"
    #: The listen backlog: past socketserver's 5, clients that arrive together
    #: would have their connects dropped and retried by the kernel after 1 s, 3 s...
    request_queue_size = 128

    def __init__(self, address: Any, handler: Any) -> None:
        # Guards _sockets and _threads. Nobody waits on it.
        self._tracked_lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name=self.thread_name,
            daemon=True,
        )
        with self._tracked_lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            self._sockets.add(request)
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._tracked_lock:
                self._sockets.discard(request)
            self.shutdown_request(request)

    def open_connections(self) -> int:
        """How many connections are being served now."""
        with self._tracked_lock:
            return len(self._sockets)

    def close_connections(self) -> None:
        """Shut down every connection being served: their threads then end."""
        with self._tracked_lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def join_threads(self, deadline: float) -> None:
        """Wait for the connections' threads until ``deadline`` (``time.monotonic()``)."""
        with self._tracked_lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
