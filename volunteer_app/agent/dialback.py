"""The agent's side of the coordinator's dial-back at join (``coordinator/reachability.py``).

While the join request is in flight, the agent listens on the TCP port its worker's swarm peer will use and
answers every connection with a random nonce; the coordinator dials the address the request came from at that
port. Whether the nonce arrives decides whether other peers can dial this worker directly, or must reach it
through the run's relay. The listener closes when the join answer arrives, and the worker then listens there.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from types import TracebackType


class DialbackListener:
    """``with DialbackListener(host, port) as listener:`` join with ``listener.port`` and ``listener.nonce``.

    ``port`` 0 (or a port in use) takes a free one."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        self.nonce = secrets.token_urlsafe(24)
        self.answered = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError:
            if port == 0:
                self._socket.close()
                raise
            self._socket.bind((host, 0))
        self._socket.listen(8)
        self._socket.settimeout(0.2)
        self.port: int = self._socket.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dialback", daemon=True)

    def __enter__(self) -> DialbackListener:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._socket.close()

    def _serve(self) -> None:
        answer = (self.nonce + "\n").encode()
        while not self._closed.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.suppress(OSError), connection:
                connection.settimeout(2)
                self.answered += 1
                connection.sendall(answer)


def port_free(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (a worker's previous daemon may still hold it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
