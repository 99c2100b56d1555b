"""``volunteer-app web``: the same app in a browser, served by textual-serve.

Each browser tab gets its own app process (``volunteer-app`` with Textual's web driver) attached to the
same agent. The page can steer the agent, so the server defends the way the agent's control API does:
it listens on loopback unless told otherwise, answers only requests whose ``Host`` is its own address
(DNS rebinding), and refuses websockets opened by pages of other origins (cross-site websocket
hijacking): the app process only starts for the page this server served.
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import sys
import threading
import time
import webbrowser
from collections.abc import Callable
from typing import Any

from aiohttp import web
from textual_serve.server import Server

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def app_command(*, coordinator: str | None = None) -> str:
    """The shell command textual-serve runs for each tab: this Python's ``volunteer-app``."""
    argv = [sys.executable, "-m", "volunteer_app.cli"]
    if coordinator:
        argv += ["--coordinator", coordinator]
    return shlex.join(argv)


class AppServer(Server):
    """textual-serve's server with origin and host checks, and the page's URLs taken from the request."""

    def __init__(
        self, command: str, *, host: str, port: int, allow_remote: bool, on_ready: Callable[[str], Any]
    ):
        display_host = f"[{host}]" if ":" in host else host
        super().__init__(
            command, host=host, port=port, title="volunteer-app", public_url=f"http://{display_host}:{port}"
        )
        self.allow_remote = allow_remote
        self.on_ready = on_ready

    def _host_allowed(self, request: web.Request) -> bool:
        if self.allow_remote:
            return True
        host = (request.host or "").rsplit(":", 1)
        name = host[0].strip("[]") if host else ""
        port = host[1] if len(host) == 2 else ""
        return is_loopback(name) and port == str(self.port)

    @web.middleware
    async def guard(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if not self._host_allowed(request):
            return web.json_response(
                {
                    "error": "forbidden_host",
                    "detail": "this page is served on this computer's loopback address only",
                },
                status=403,
            )
        origin = request.headers.get("Origin")
        if request.path == "/ws" and origin is not None and origin != f"{request.scheme}://{request.host}":
            return web.json_response(
                {"error": "forbidden_origin", "detail": "only this server's own page may open the app"},
                status=403,
            )
        response: web.StreamResponse = await handler(request)
        return response

    async def _make_app(self) -> web.Application:
        app = await super()._make_app()
        app.middlewares.append(self.guard)
        return app

    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        # the page's websocket and static URLs follow the address the browser used
        self.public_url = f"{request.scheme}://{request.host}"
        response: web.StreamResponse = await super().handle_index(request)
        return response

    async def on_startup(self, app: web.Application) -> None:
        self.on_ready(f"http://{'[' + self.host + ']' if ':' in self.host else self.host}:{self.port}/")

    def initialize_logging(self) -> None:
        """Quiet: the command prints its own lines; textual-serve's logger reports problems only."""
        import logging

        logging.getLogger("textual-serve").setLevel(logging.WARNING)


def open_when_listening(url: str, host: str, port: int, *, timeout: float = 30.0) -> threading.Thread:
    """Open ``url`` in the browser once the server accepts connections (in a thread, not blocking it)."""

    def wait_and_open() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
                webbrowser.open(url)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=wait_and_open, name="open-browser", daemon=True)
    thread.start()
    return thread


def serve_web(
    *,
    host: str,
    port: int,
    allow_remote: bool,
    open_browser: bool,
    coordinator: str | None,
    say: Callable[[str], Any],
) -> None:
    """Serve the app until Ctrl-C. ``port`` 0 picks a free port."""
    if port == 0:
        port = free_port(host)
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host

    def ready(url: str) -> None:
        say(
            f"serving volunteer-app at {url} (each browser tab is its own app attached to the agent); Ctrl-C stops"
        )
        if open_browser:
            open_when_listening(
                url if not host.startswith("0.") else f"http://127.0.0.1:{port}/", connect_host, port
            )

    server = AppServer(
        app_command(coordinator=coordinator), host=host, port=port, allow_remote=allow_remote, on_ready=ready
    )
    server.serve()
