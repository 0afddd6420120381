"""A client that trickles its request: one byte every 0.9 s, never the whole request within
a service's head timeout (controller/bounded_http.py), until the service closes it."""

from __future__ import annotations

import select
import socket
import threading


class SlowClient:
    """Connects to 127.0.0.1:`port`; once started, sends `request` a byte at a time on a
    thread of its own. `sent`: the bytes sent so far; `cut`: set once it stopped (the
    service closed the connection, or answered it)."""

    def __init__(self, port: int, request: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.request = request
        self.sent: list[int] = []
        self.cut = threading.Event()

    def start(self) -> SlowClient:
        threading.Thread(target=self._trickle, daemon=True).start()
        return self

    def close(self) -> None:
        self.sock.close()

    def _trickle(self) -> None:
        for byte in self.request:
            try:
                self.sock.sendall(bytes([byte]))
            except OSError:
                break
            self.sent.append(byte)
            if select.select([self.sock], [], [], 0.9)[0]:  # the service answered (and closed it)
                break
        self.cut.set()
