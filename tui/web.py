"""``volunteer-app web``: the same app in a browser, served by textual-serve.

Each browser tab gets its own app process (``volunteer-app`` with Textual's web driver) attached to the
same agent, and that app steers the agent: pause, snooze, join a run. So the page must be as hard to reach
as the agent's control API, from other users of this computer and from pages of other sites alike. The
server defends the way Jupyter does:

* **A login link.** Each server start makes a fresh random login secret and prints (and opens) the link
  ``http://127.0.0.1:PORT/?token=SECRET``. Visiting it sets a session cookie (HttpOnly, SameSite=Strict,
  random per server start, named after the port) and sends the browser on to the clean URL. The agent's
  control token (``control-token`` in the config dir, mode 0600) is accepted in place of the login secret:
  whoever can read it steers the agent anyway, and it lets the volunteer in when the printed link is
  lost. Every request without the cookie or a token, the page, its static files and above all the
  ``/ws`` websocket that starts an app process, is refused with 403 and a short page (browsers) or
  JSON (anything else). Secrets are compared with :func:`hmac.compare_digest`.
* **Host names it was started for** (DNS rebinding): the ``Host`` of every request must name the listen
  address and port, a loopback name when it listens on loopback or on every interface (then this
  computer's own addresses too), or a name given in ``allowed_hosts``; any other name is refused, also
  with ``allow_remote``.
* **Its own page only** (cross-site websocket hijacking): the websocket's ``Origin`` must be the page's own
  origin. Cookies are not separated by port, so a page that another user serves on ``127.0.0.1:OTHER``
  gets the cookie sent along; the ``Origin`` check is what stops it.
* **A cap on app processes**: each tab's app takes ~70 MB, so at most ``max_sessions`` run at once; a
  websocket beyond that waits a moment for a tab to close (a reloaded tab frees its slot just after the
  new one asks) and is then refused with 503 before any process starts.

The link never appears in another process's command line (which every user of the computer can read in
``ps``): ``open_browser`` opens a private file (mode 0600) that forwards to it, as Jupyter does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import webbrowser
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import aiohttp_jinja2
from aiohttp import web
from textual_serve.server import Server, to_int

from volunteer_app.settings import AgentSettings

logger = logging.getLogger(__name__)

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD = frozenset({"0.0.0.0", "::", ""})
TOKEN_PARAM = "token"
DEFAULT_MAX_SESSIONS = 4
"""App processes at once: four tabs, ~300 MB. Raise it for a shared screen, lower it on a small machine."""
SESSION_GRACE = 3.0
"""Seconds a websocket beyond the cap waits for a slot before it is refused (a reloaded tab's old app
quits within about a second)."""

SHUTDOWN_TIMEOUT = 3.0
"""Seconds the open tabs get to end when the server stops (their apps are told to quit)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


# ----------------------------------------------------------------------------------------- host names
def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or an ``allowed_hosts`` entry) as (lower-case name without brackets, port or
    None); None when it is malformed."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):  # [v6]:port
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if not rest:
            return name, None
        if not rest.startswith(":"):
            return None
        port_text = rest[1:]
    elif value.count(":") == 1:
        name, port_text = value.split(":")
    elif ":" in value:  # a bare IPv6 address: valid as an entry, not as a Host header with a port
        return value, None
    else:
        return value.rstrip("."), None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name.rstrip("."), int(port_text)


def interface_addresses() -> frozenset[str]:
    """This computer's own IP addresses (what a browser on the network types for a server that listens
    on every interface). An address literal cannot be rebound by DNS, unlike a name."""
    import psutil

    found: set[str] = set()
    with contextlib.suppress(OSError):
        for addresses in psutil.net_if_addrs().values():
            for address in addresses:
                if address.family in (socket.AF_INET, socket.AF_INET6):
                    found.add(address.address.split("%", 1)[0].lower())
    return frozenset(found)


@dataclass(frozen=True)
class HostRules:
    """Which ``Host`` values reach this server: see :func:`host_rules`."""

    port: int
    names: frozenset[str]
    """Names (and address literals) allowed with the listen port."""
    configured: tuple[tuple[str, int | None], ...] = ()
    """``allowed_hosts``: a name with its port, or with None for any port (a reverse proxy)."""

    def allows(self, header: str | None) -> bool:
        parsed = split_host(header or "")
        if parsed is None:
            return False
        name, port = parsed
        port = 80 if port is None else port
        if name in self.names and port == self.port:
            return True
        return any(
            name == allowed and allowed_port in (None, port) for allowed, allowed_port in self.configured
        )


def host_rules(
    host: str, port: int, allowed_hosts: Iterable[str] = (), *, own_addresses: Iterable[str] | None = None
) -> HostRules:
    """The ``Host`` values a server listening on ``host``:``port`` answers.

    :param host: the listen address; on loopback the loopback names are allowed too, on every interface
        (``0.0.0.0``, ``::``) also this computer's own addresses (``own_addresses``, default: read them).
    :param allowed_hosts: more names, e.g. ``volunteers.example.org`` behind a reverse proxy
        (``name:port`` for one port only). Only names the volunteer chose: a name that an attacker's DNS
        answers with this computer's address is how DNS rebinding gets in.
    :raises ValueError: an ``allowed_hosts`` entry is not a host name.
    """
    listen = host.strip("[]").lower()
    names = {listen}
    if listen in WILDCARD or is_loopback(listen):
        names |= LOOPBACK
    if listen in WILDCARD:
        names |= set(interface_addresses() if own_addresses is None else own_addresses)
    configured = []
    for entry in allowed_hosts:
        parsed = split_host(entry)
        if parsed is None or not parsed[0]:
            raise ValueError(f"{entry!r} is not a host name (a name, or name:port)")
        configured.append(parsed)
    names.discard("")
    return HostRules(port=port, names=frozenset(names), configured=tuple(configured))


def same_origin(origin: str | None, host_header: str) -> bool:
    """Whether a websocket's ``Origin`` is the page this server served under ``host_header`` (checked)."""
    if not origin:
        return False
    scheme, _, rest = origin.strip().lower().partition("://")
    return scheme in ("http", "https") and rest == host_header.strip().lower()


# ----------------------------------------------------------------------------------------- secrets
def read_control_token(settings: AgentSettings) -> str | None:
    """The agent's control token (the file the agent writes, mode 0600), or None when there is none yet.

    Read here rather than through ``volunteer_app.agent``, which the app must not import; the same rule
    as the agent's: at least 32 characters."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        token = settings.control_token_path.read_text().strip()
        if len(token) >= 32:
            return token
    return None


@dataclass(frozen=True)
class WebAccess:
    """The secrets of one server start.

    :param login_secret: the printed link's token; fresh per start, so that a link left in a terminal's
        scrollback or a browser's history opens nothing once this server has stopped.
    :param session_secret: the cookie's value; fresh per start, never printed.
    :param control_token: the agent's control token, accepted in place of the login secret.
    """

    login_secret: str
    session_secret: str
    control_token: str | None = None

    @classmethod
    def new(cls, *, control_token: str | None = None) -> WebAccess:
        return cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32), control_token)

    def token_valid(self, token: str | None) -> bool:
        if not token:
            return False
        given = token.encode()
        valid = hmac.compare_digest(given, self.login_secret.encode())
        if self.control_token:  # both compared, whatever the first said: no timing hint which one it was
            valid = hmac.compare_digest(given, self.control_token.encode()) or valid
        return valid

    def cookie_valid(self, value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(str(value).encode(), self.session_secret.encode())


def cookie_name(port: int) -> str:
    """One cookie per port: cookies are not separated by port, and two servers must not sign out each other."""
    return f"volunteer-app-web-{port}"


# ----------------------------------------------------------------------------------------- refusals
REFUSALS: dict[str, tuple[str, str]] = {
    "forbidden_host": (
        "This address is not this server's",
        "volunteer-app web answers only the addresses it was started for (its own address, the loopback "
        "names, and the names given with allowed hosts).",
    ),
    "login_required": (
        "Open the link that volunteer-app web printed",
        "This page steers your volunteer agent, so it needs the login link that `volunteer-app web` printed "
        "when it started (http://…/?token=…). Open that link; it lets this browser in until the server stops.",
    ),
    "forbidden_origin": (
        "Only this server's own page may open the app",
        "A page of another site (or another port) tried to start the app.",
    ),
    "too_many_sessions": (
        "Too many browser tabs",
        "Each tab runs its own copy of the app; close a tab of volunteer-app, then reload this one.",
    ),
}


def refusal_body(request: web.Request, error: str, detail: str | None = None) -> tuple[str, str]:
    """(body, content type) of a refusal: a short page for a browser, ``{"error", "detail"}`` JSON for
    anything else. Nothing of the request is echoed back."""
    title, text = REFUSALS[error]
    detail = detail or text
    if "text/html" in request.headers.get("Accept", ""):
        page = (
            '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>volunteer-app: '
            f'{escape(title)}</title></head><body style="font-family: sans-serif; max-width: 40em; margin: 4em '
            f'auto"><h1>{escape(title)}</h1><p>{escape(detail)}</p></body></html>'
        )
        return page, "text/html"
    return json.dumps({"error": error, "detail": detail}), "application/json"


def refusal(request: web.Request, error: str, status: int, detail: str | None = None) -> web.Response:
    body, content_type = refusal_body(request, error, detail)
    return web.Response(status=status, text=body, content_type=content_type)


def landing_page(target: str, *, message: str = "Signed in.") -> str:
    """What the login link answers (with the cookie): it forwards to the clean URL.

    Not a 303 redirect: when the link is opened from another origin (the private forwarding file, a chat
    program's link), the browser treats the whole redirect chain as cross-site and leaves the new
    SameSite=Strict cookie out of the redirected request. A forward by this page itself is same-site."""
    url = escape(target, quote=True)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="0; url={url}"><title>volunteer-app</title></head>'
        f'<body><p>{escape(message)} <a href="{url}">Continue to volunteer-app</a>.</p></body></html>'
    )


# ----------------------------------------------------------------------------------------- the server
class AppServer(Server):
    """textual-serve's server behind the login, host, origin and session checks of this module.

    :param command: the shell command each session runs (:func:`app_command`).
    :param access: this start's secrets.
    :param hosts: the ``Host`` values it answers (:func:`host_rules`).
    :param max_sessions: app processes at once.
    :param session_grace: seconds a websocket beyond the cap waits for a slot before it is refused.
    :param on_ready: called with the login link once the server listens.
    :param warn: where the server says what the volunteer should know (a refused tab).
    """

    def __init__(
        self,
        command: str,
        *,
        host: str,
        port: int,
        access: WebAccess,
        hosts: HostRules,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        session_grace: float = SESSION_GRACE,
        on_ready: Callable[[str], Any] = lambda link: None,
        warn: Callable[[str], Any] = lambda text: None,
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        display_host = f"[{host}]" if ":" in host else host
        super().__init__(
            command, host=host, port=port, title="volunteer-app", public_url=f"http://{display_host}:{port}"
        )
        self.access = access
        self.hosts = hosts
        self.max_sessions = max_sessions
        self.session_grace = session_grace
        self.on_ready = on_ready
        self.warn = warn
        self.sessions = 0
        self._slots: asyncio.Condition | None = None

    @property
    def link_host(self) -> str:
        """The address the printed link names: loopback for a server on every interface."""
        if self.host in WILDCARD:
            return "127.0.0.1"
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def link(self) -> str:
        return f"http://{self.link_host}:{self.port}/?{TOKEN_PARAM}={self.access.login_secret}"

    # ------------------------------------------------------------------ the checks
    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Host, then login, then (for the websocket) origin: in that order, before any handler runs."""
        host = request.headers.get("Host", "")
        if not self.hosts.allows(host):
            logger.info("refused %s %s: Host %r", request.method, request.path, host)
            return refusal(request, "forbidden_host", 403)
        token = request.query.get(TOKEN_PARAM)
        by_token = self.access.token_valid(token)
        if not by_token and not self.access.cookie_valid(request.cookies.get(cookie_name(self.port))):
            logger.info("refused %s %s: not signed in", request.method, request.path)
            return refusal(request, "login_required", 403)
        if request.path == "/ws" and not same_origin(request.headers.get("Origin"), host):
            logger.info("refused the websocket of origin %r", request.headers.get("Origin"))
            return refusal(request, "forbidden_origin", 403)
        if by_token and request.path == "/" and request.method == "GET":
            return self.sign_in(request)
        return await handler(request)

    def sign_in(self, request: web.Request) -> web.Response:
        """The login link: set the session cookie and forward to the same URL without the token."""
        response = web.Response(text=landing_page(str(request.rel_url.without_query_params(TOKEN_PARAM))))
        response.content_type = "text/html"
        response.set_cookie(
            cookie_name(self.port), self.access.session_secret, path="/", httponly=True, samesite="Strict"
        )
        return response

    @staticmethod
    async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
        """No framing by other pages (clickjacking of the app's keys), no token in a Referer, no caching."""
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-store"

    async def _make_app(self) -> web.Application:
        app = await super()._make_app()
        app.middlewares.append(self.guard)
        app.on_response_prepare.append(self.security_headers)
        self._slots = asyncio.Condition()
        return app

    # ------------------------------------------------------------------ the pages
    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        """textual-serve's page, its websocket and static URLs following the address the browser used
        (checked by :meth:`guard`); built per request, not from shared state."""
        base = f"{request.scheme}://{request.headers['Host']}"
        router = request.app.router
        websocket = ("wss:" if base.startswith("https:") else "ws:") + base.split(":", 1)[1]
        context = {
            "font_size": to_int(request.query.get("fontsize", "16"), 16),
            "app_websocket_url": websocket + str(router["websocket"].url_for()),
            "config": {
                "static": {"url": base + str(router["static"].url_for(filename="/")).rstrip("/") + "/"}
            },
            "application": {"name": self.title},
        }
        return aiohttp_jinja2.render_template("app_index.html", request, context)

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """One app process per websocket, at most :attr:`max_sessions` at once (503 beyond, before any
        process starts)."""
        if not await self._take_slot():
            self.warn(
                f"refused a browser tab: {self.max_sessions} already run the app (the most allowed); close one"
            )
            body, content_type = refusal_body(request, "too_many_sessions")
            raise web.HTTPServiceUnavailable(text=body, content_type=content_type)
        try:
            return await super().handle_websocket(request)
        finally:
            await self._free_slot()

    async def _take_slot(self) -> bool:
        assert self._slots is not None
        async with self._slots:
            try:
                await asyncio.wait_for(
                    self._slots.wait_for(lambda: self.sessions < self.max_sessions), self.session_grace
                )
            except asyncio.TimeoutError:
                return False
            self.sessions += 1
            return True

    async def _free_slot(self) -> None:
        assert self._slots is not None
        async with self._slots:
            self.sessions -= 1
            self._slots.notify()

    async def on_startup(self, app: web.Application) -> None:
        """Nothing: textual-serve prints its banner here, before the port even listens (see :meth:`run`)."""

    def serve(self, debug: bool = False) -> None:
        """Serve until SIGINT or SIGTERM."""
        self.debug = debug
        self.initialize_logging()
        asyncio.run(self.run())

    async def run(self) -> None:
        """Listen, then call ``on_ready`` with the link (a link printed earlier may not answer yet), and
        serve until SIGINT or SIGTERM. An address in use raises :class:`OSError`."""
        runner = web.AppRunner(
            await self._make_app(), handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(signum, stop.set)
            self.on_ready(self.link)
            await stop.wait()
        finally:
            await runner.cleanup()

    def initialize_logging(self) -> None:
        """Quiet: the command prints its own lines; textual-serve's logger reports problems only."""
        logging.getLogger("textual-serve").setLevel(logging.WARNING)


# ----------------------------------------------------------------------------------------- the browser
def forwarding_file(link: str, directory: Path) -> Path:
    """A private page (mode 0600, in a 0700 directory) that forwards to ``link``: what the browser is
    started with, so that the login secret is not in a command line that ``ps`` shows every user."""
    path = directory / "open-volunteer-app.html"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(landing_page(link, message="Opening volunteer-app…"))
    return path


def open_when_listening(url: str, host: str, port: int, *, timeout: float = 30.0) -> threading.Thread:
    """Open ``url`` in the browser once the server accepts connections (in a thread, not blocking it)."""

    def wait_and_open() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
                webbrowser.open(url)
                return
            time.sleep(0.1)  # polling a port that is about to open: there is no event to wait for

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
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    allowed_hosts: Sequence[str] = (),
    settings: AgentSettings | None = None,
    command: str | None = None,
    session_grace: float = SESSION_GRACE,
) -> None:
    """Serve the app until Ctrl-C (or SIGTERM); see the module's docstring for who gets in.

    :param host: the listen address; anything but loopback needs ``allow_remote`` (the CLI checks).
    :param port: the port; 0 picks a free one.
    :param allow_remote: listening beyond loopback is meant. Other computers still need the login link,
        and their ``Host`` must be this computer's address or one of ``allowed_hosts``.
    :param open_browser: open the login link in the browser (through a private forwarding file).
    :param coordinator: preselected on each tab's join screen.
    :param say: prints the login link and what the volunteer should know.
    :param max_sessions: browser tabs (app processes, ~70 MB each) at once.
    :param allowed_hosts: more ``Host`` names to answer (a reverse proxy's), ``name`` or ``name:port``.
    :param settings: where the agent's control token is (accepted in place of the link's token).
    :param command: the shell command of each tab (default: this Python's ``volunteer-app``).
    :param session_grace: seconds a tab beyond ``max_sessions`` waits for a free slot.
    :raises ValueError: an ``allowed_hosts`` entry is malformed, or ``max_sessions`` < 1.
    """
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"{host} is not a loopback address: pass allow_remote to listen there")
    if port == 0:
        port = free_port(host)
    settings = settings if settings is not None else AgentSettings()
    server = AppServer(
        command or app_command(coordinator=coordinator),
        host=host,
        port=port,
        access=WebAccess.new(control_token=read_control_token(settings)),
        hosts=host_rules(host, port, allowed_hosts),
        max_sessions=max_sessions,
        session_grace=session_grace,
        warn=say,
    )
    private = Path(tempfile.mkdtemp(prefix="volunteer-app-web-"))  # mode 0700

    def ready(link: str) -> None:
        say(
            f"serving volunteer-app at {link} (open this link, it signs the browser in; each tab is its own app "
            f"attached to the agent, at most {max_sessions} at once); Ctrl-C stops"
        )
        if open_browser:
            page = forwarding_file(link, private)
            open_when_listening(page.as_uri(), "127.0.0.1" if host in WILDCARD else host, port)

    server.on_ready = ready
    try:
        server.serve()
    finally:
        shutil.rmtree(private, ignore_errors=True)
