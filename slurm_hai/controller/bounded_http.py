"""The HTTP of the privileged services' endpoints (the policy daemon's: metrics.py's /metrics,
why.py's /why and /jobs; the lighthouse service's, lighthouse.py): what any user who can
reach the port sends is bounded (standard library only).

Any local user (any host, at the default 0.0.0.0) can connect, and the services run as root
or as the SlurmUser. Each connection is answered on a thread of its own, so that a slow one
never holds another, and each is bounded:

- its request line and headers: at most MAX_HEAD bytes (431 beyond; a handler may allow more,
  as why.py does for its questions' job ids), read whole within
  HEAD_TIMEOUT seconds of the connection, however slowly they trickle in (408 after: a client
  that sends one byte every 0.9 s does not hold its thread longer); the request's body, if
  any, is never read;
- its answer is written within WRITE_TIMEOUT (a client that does not read is dropped);
- at most MAX_CONNECTIONS at once: one more drops the oldest (a crowd of idle connections
  can neither use up the daemon's threads and descriptors nor keep a scrape out).
A refusal is one line of text; it is logged at debug level only (a user cannot fill the log).
"""

from __future__ import annotations

import io
import logging
import socket
import socketserver
import sys
import threading
import time
from typing import Any

log = logging.getLogger("hai-policyd")

MAX_HEAD = 8192  # bytes of request line and headers (a scrape or a `hai` question sends < 300)
HEAD_TIMEOUT = 5.0  # seconds from the connection to the end of the headers
WRITE_TIMEOUT = 10.0  # seconds to write an answer (each write: sendall's timeout is its whole)
MAX_CONNECTIONS = 64  # connections served at once; the oldest is dropped for one more


class HeadRefused(Exception):
    """A request whose head is not read: `status` and the line that says why."""

    def __init__(self, status: str, line: str) -> None:
        super().__init__(line)
        self.status = status


def _head_end(data: bytes) -> int:
    """Where the head ends in `data` (after its empty line; http.server takes bare LF too), -1: not yet."""
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := data.find(sep)) >= 0]
    return min(ends) if ends else -1


def read_head(sock: socket.socket, timeout: float = HEAD_TIMEOUT, limit: int = MAX_HEAD) -> bytes:
    """The request line and headers from `sock`, at most `limit` bytes, all within `timeout`
    seconds; HeadRefused otherwise, OSError when the client goes."""
    deadline = time.monotonic() + timeout
    data = b""
    while (end := _head_end(data)) < 0:
        if len(data) > limit:
            raise HeadRefused("431 Request Header Fields Too Large",
                              f"request line and headers over {limit} bytes; send a shorter request")
        left = deadline - time.monotonic()
        if left <= 0:
            raise HeadRefused("408 Request Timeout", f"request not sent whole within {timeout:g} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(limit + 1 - len(data))
        except TimeoutError:
            continue  # the deadline above says so
        if not chunk:
            raise ConnectionError("the client went before its request was whole")
        data += chunk
    if end > limit:
        raise HeadRefused("431 Request Header Fields Too Large",
                          f"request line and headers over {limit} bytes; send a shorter request")
    return data[:end]


class BoundedHandler:
    """Put before an http.server.BaseHTTPRequestHandler (or wsgiref's WSGIRequestHandler): the
    head is read by read_head, the rest of the request parsed from it as usual."""

    connection: socket.socket
    rfile: Any
    max_head = MAX_HEAD

    def handle(self) -> None:
        try:
            head = read_head(self.connection, HEAD_TIMEOUT, self.max_head)
        except HeadRefused as e:
            _refuse(self.connection, e.status, str(e))
            self.log_message("refused: %s", str(e))
            return
        except OSError:
            return
        self.rfile = io.BytesIO(head)
        self.connection.settimeout(WRITE_TIMEOUT)
        super().handle()  # type: ignore[misc]

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        log.debug("http: " + format, *args)


def _refuse(sock: socket.socket, status: str, line: str) -> None:
    body = f"{line}\n".encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(f"HTTP/1.0 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
    except OSError:
        pass


class BoundedServer(socketserver.ThreadingMixIn):
    """Put before an http.server.HTTPServer (or wsgiref's WSGIServer): a thread per connection,
    at most MAX_CONNECTIONS at once; one more drops the oldest."""

    daemon_threads = True
    block_on_close = False
    max_connections = MAX_CONNECTIONS
    request_queue_size = 2 * MAX_CONNECTIONS  # a burst of connections waits to be taken, not to be retried

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: dict[socket.socket, None] = {}  # in the order they came: the oldest first
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            while len(self._open) >= self.max_connections:
                oldest = next(iter(self._open))
                del self._open[oldest]
                try:  # its thread's read or write ends at once; its thread closes it
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._open[request] = None
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # the client went, was dropped, or did not read in time
            log.debug("http: %s went before its answer", client_address)
        else:
            log.exception("http: answering %s", client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)  # type: ignore[misc]


def family_of(address: str) -> socket.AddressFamily:
    """The family of the address to listen on (an IPv6 address takes AF_INET6)."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET
