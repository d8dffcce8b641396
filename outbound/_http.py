"""An HTTP server with a thread per connection that it can end and join, and a
socket reader bounded by a deadline.

The server is used by the platform stand-in (:mod:`outbound.simulator`) and
the outbox's status page (:mod:`outbound.outbox.web`): both must stop with no
thread left behind, also while a client keeps a connection open. The reader
bounds a whole request (the status page) or a whole answer
(:class:`~outbound.telegram.TelegramSender`), not each read.
"""

from __future__ import annotations

import http.client
import http.server
import io
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from outbound._compat import TIMEOUT_MAX, unlimited_past_max
from outbound._fork import renewed_after_fork

__all__ = ["ConnectionThreadsServer", "DeadlineReader", "join_until"]


def join_until(thread: threading.Thread, deadline: float) -> None:
    """Wait for ``thread`` to end until ``deadline`` (``time.monotonic()``; ``inf``:
    forever), in waits ``Thread.join`` accepts. A thread never started is not waited for."""
    while thread.is_alive():
        left = deadline - time.monotonic()
        if not left > 0:
            return
        thread.join(min(left, TIMEOUT_MAX))


class DeadlineReader(io.RawIOBase):
    """Reads a socket with the time left before ``deadline()`` (a ``time.monotonic()``
    instant, read at each read) as each read's timeout; past it, ``TimeoutError(what)``.

    A socket timeout alone bounds each ``recv``, not the whole: a peer that
    trickles a byte at a time would never trip it. ``keep``: the file the
    caller made over the socket first, closed with this one (it holds a
    reference that keeps the socket open). ``limit``: the most bytes read in
    all; a read past it raises ``http.client.HTTPException``. Wrap it in
    ``io.BufferedReader``.
    """

    def __init__(
        self,
        sock: socket.socket,
        deadline: Callable[[], float],
        keep: Any,
        what: str,
        limit: int | None = None,
    ) -> None:
        self._sock = sock
        self._deadline = deadline
        self._keep = keep
        self._what = what
        self._left = limit  # (bytes: None, no limit)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        try:
            self._keep.close()
        finally:
            super().close()

    def readinto(self, buffer: Any) -> int:
        left = self._deadline() - time.monotonic()
        if left <= 0:
            raise TimeoutError(self._what)
        self._sock.settimeout(unlimited_past_max(left))
        count = int(self._sock.recv_into(buffer))
        if self._left is not None:
            self._left -= count
            if self._left < 0:
                raise http.client.HTTPException("the answer runs past the most read of one")
        return count


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
        # Guards _sockets and _threads. Nobody waits on it. Made new in a
        # forked child (a parent thread may hold it at the fork).
        self._tracked_lock = renewed_after_fork(threading.Lock())
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        super().__init__(address, handler)

    def get_request(self) -> tuple[Any, Any]:
        # Tracked from its accept to its close (see shutdown_request): a fork
        # at any point between finds it in _sockets (see forget_inherited).
        request, client_address = super().get_request()
        with self._tracked_lock:
            self._sockets.add(request)
        return request, client_address

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:
            # Untracked once its descriptor is closed: not while a handler's
            # file still holds it open (socketserver shuts a connection down
            # for writing only, when a Ctrl-C landed in the start of its
            # thread: that thread reads on, and close_connections must still
            # reach it).
            if request.fileno() == -1:
                with self._tracked_lock:
                    self._sockets.discard(request)

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
        try:
            thread.start()
        except Exception:
            # No thread (none can be started): not tracked, its connection
            # closed. (A Ctrl-C landing here most likely came once the thread
            # ran: it stays tracked, and whatever is left is closed at close.)
            with self._tracked_lock:
                self._threads.remove(thread)
            self.shutdown_request(request)
            raise

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
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

    def forget_inherited(self) -> None:
        """In a forked child: close this process's copies of the listening socket
        and of the connections being served, without shutting any down (a
        shutdown acts on the socket both processes share: the parent's clients
        would be cut off)."""
        with self._tracked_lock:
            sockets, self._sockets = list(self._sockets), set()
            self._threads = []
        for sock in [self.socket, *sockets]:
            try:
                # The descriptor itself: close() would leave it open while a
                # file made over the socket (by a handler thread, which is
                # not in this process) still refers to it.
                os.close(sock.detach())
            except OSError:
                pass

    def join_threads(self, deadline: float) -> None:
        """Wait for the connections' threads until ``deadline`` (``time.monotonic()``)."""
        with self._tracked_lock:
            threads = list(self._threads)
        me = threading.current_thread()  # (a handler that closes the server)
        for thread in threads:
            if thread is not me:
                join_until(thread, deadline)

    def close_left(self) -> None:
        """Close the connections still tracked once their threads were waited for
        (one whose thread never began, a Ctrl-C between accept and thread);
        none while a thread still serves (past the wait: it ends with its
        reading, its connection already shut down)."""
        with self._tracked_lock:
            if any(thread.is_alive() for thread in self._threads):
                return
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            try:
                os.close(sock.detach())  # (the descriptor, whatever file holds it)
            except OSError:
                pass
