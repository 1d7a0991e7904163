"""One daemon's connection to the engine's LocalBackend (the engine side).

:class:`_Daemon` is a registered daemon: what it said of itself in its hello,
the nodes it serves, and its socket, written through a queue by a thread of
its own so that a slow daemon never blocks the engine.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from typing import Any

from mlwe.backends.local.protocol import encode


class _Daemon:
    """One registered daemon connection; writes go through a queue to its own thread."""

    def __init__(self, daemon_id: str, sock: socket.socket, hello: dict[str, Any]) -> None:
        self.id = daemon_id
        self.host = str(hello.get("host", "?"))
        self.pid = hello.get("pid")
        self.machine = hello.get("machine") if isinstance(hello.get("machine"), dict) else {}
        self.nodes: list[str] = []
        self.sock = sock
        self.connected = True
        self.last_seen = time.monotonic()
        self.out: queue.Queue[bytes | None] = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, name=f"mlwe-local-w-{daemon_id}",
                                       daemon=True)
        self.writer.start()

    def send(self, msg: dict[str, Any]) -> bool:
        if not self.connected:
            return False
        self.out.put(encode(msg))
        return True

    def _write_loop(self) -> None:
        sock = self.sock
        while True:
            data = self.out.get()
            if data is None:
                return
            try:
                sock.sendall(data)
            except OSError:
                self.connected = False
                return

    def close(self) -> None:
        self.connected = False
        self.out.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def describe(self) -> str:
        return f"daemon {self.id} ({self.host}, pid {self.pid})"

