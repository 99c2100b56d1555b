"""Who gets into `volunteer-app web`: a real server process (``serve_web``) whose tabs run a tiny Textual app,
real HTTP requests and real websockets, and the app processes it starts counted with psutil.

Another user of this computer, or a page of another site, must not reach the app that steers the agent:
without the login link (its cookie) nothing is served and no app process starts; a forged cookie, a
foreign Host (DNS rebinding, also with ``allow_remote``) and a foreign Origin are refused; and at most
``max_sessions`` app processes run at once."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Origin

from tests.conftest import python_env
from tests.tui.conftest import stop_web_server, wait_for_web_link
from tui.web import cookie_name, forwarding_file, host_rules, same_origin, split_host

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = pytest.mark.timeout(120)

MINI_APP = """
from textual.app import App, ComposeResult
from textual.widgets import Static


class Mini(App[None]):
    def compose(self) -> ComposeResult:
        yield Static("mini app ready")


Mini().run()
"""

LAUNCH = """
import json, sys
from tui.web import serve_web
from volunteer_app.settings import AgentSettings
options = json.loads(sys.argv[1])
serve_web(
    host=options["host"], port=0, allow_remote=options["allow_remote"], open_browser=False, coordinator=None,
    say=lambda text: print(text, flush=True), max_sessions=options["max_sessions"],
    allowed_hosts=options["allowed_hosts"], settings=AgentSettings(config_dir=options["config_dir"]),
    command=options["command"], session_grace=0.5,
)
"""


def wait_for(what: str, condition: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``condition`` until it is true; fail after ``timeout`` s (processes give no event to wait on)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class Served:
    """A `serve_web` process, its login link and what it printed."""

    process: subprocess.Popen[str]
    link: str
    lines: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.link.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def origin(self) -> str:
        return self.base

    @property
    def token(self) -> str:
        return self.link.split("?token=", 1)[1]

    def app_processes(self) -> list[psutil.Process]:
        """The tabs' app processes: Pythons running the mini app (not the shells that start them)."""
        found = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                argv = child.cmdline()
                python = bool(argv) and Path(argv[0]).name.startswith("python")
                if python and any("mini_app.py" in part for part in argv) and child.status() != "zombie":
                    found.append(child)
        return found

    def read_lines(self) -> None:
        """What the server printed since the last call (without blocking)."""
        assert self.process.stdout is not None
        while select.select([self.process.stdout], [], [], 0)[0]:
            line = self.process.stdout.readline()
            if not line:
                return
            self.lines.append(line)

    def sign_in(self) -> str:
        """Open the login link like a browser; returns the session cookie's value."""
        response = httpx.get(self.link, headers={"Accept": "text/html"}, timeout=10)
        assert response.status_code == 200, response.text
        cookie = SimpleCookie()
        cookie.load(response.headers["set-cookie"])
        return cookie[cookie_name(self.port)].value

    def websocket(
        self,
        *,
        cookie: str | None = None,
        origin: str | None = None,
        host: str | None = None,
        query: str = "",
    ) -> ClientConnection:
        """A websocket to ``/ws`` as a browser opens it (``host``: the name the browser thinks it talks to,
        the way a DNS-rebound page reaches this server)."""
        headers = {} if cookie is None else {"Cookie": f"{cookie_name(self.port)}={cookie}"}
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        try:
            return connect(
                f"ws://{host or '127.0.0.1'}:{self.port}/ws?width=80&height=24{query}",
                sock=sock,
                origin=Origin(origin or self.origin),
                additional_headers=headers,
                open_timeout=10,
            )
        except BaseException:
            sock.close()
            raise


@contextlib.contextmanager
def serve(
    tmp_path: Path,
    *,
    host: str = "127.0.0.1",
    allow_remote: bool = False,
    max_sessions: int = 4,
    allowed_hosts: tuple[str, ...] = (),
    control_token: str | None = None,
) -> Iterator[Served]:
    """Start ``serve_web`` in its own process group (its tabs run the mini app) and yield it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    app = tmp_path / "mini_app.py"
    app.write_text(MINI_APP)
    config_dir = tmp_path / "config"
    config_dir.mkdir(exist_ok=True)
    if control_token is not None:
        (config_dir / "control-token").write_text(control_token + "\n")
    options = {
        "host": host,
        "allow_remote": allow_remote,
        "max_sessions": max_sessions,
        "allowed_hosts": list(allowed_hosts),
        "config_dir": str(config_dir),
        "command": f"{sys.executable} {app}",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, json.dumps(options)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env(), start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        lines: list[str] = []
        link = wait_for_web_link(process, lines, "serve_web")
        yield Served(process, link, lines)
    finally:
        stop_web_server(process)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # app processes the server left behind


def refused(open_socket: Callable[[], ClientConnection]) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of a websocket handshake that must be refused."""
    with pytest.raises(InvalidStatus) as caught:
        open_socket().close()
    response = caught.value.response
    return response.status_code, json.loads(response.body or b"{}")


def app_output(ws: ClientConnection, text: bytes = b"mini app ready", timeout: float = 30.0) -> bytes:
    """Terminal output the app sends the page, until ``text`` appears."""
    received = b""
    deadline = time.monotonic() + timeout
    while text not in received:
        left = deadline - time.monotonic()
        assert left > 0, f"the app never showed {text!r}: {received[-500:]!r}"
        with contextlib.suppress(TimeoutError):
            frame = ws.recv(timeout=left)
            received += frame if isinstance(frame, bytes) else b""
    return received


# ----------------------------------------------------------------------------------------- the login
def test_without_the_login_nothing_is_served_and_no_app_starts(tmp_path: Path) -> None:
    with serve(tmp_path) as server:
        status, body = refused(lambda: server.websocket())
        assert (status, body["error"]) == (403, "login_required")
        page = httpx.get(server.base + "/", headers={"Accept": "text/html"}, timeout=10)
        assert page.status_code == 403 and "Open the link that volunteer-app web printed" in page.text
        assert page.headers["content-type"].startswith("text/html")
        assert httpx.get(server.base + "/static/js/textual.js", timeout=10).status_code == 403
        assert httpx.get(server.base + "/ws", timeout=10).json()["error"] == "login_required"
        assert server.app_processes() == [], "a refused websocket must not start an app process"
        assert server.token not in "".join(server.lines[:-1]), "the token is printed in the link only"


def test_the_login_link_signs_the_browser_in(tmp_path: Path) -> None:
    with serve(tmp_path) as server:
        landing = httpx.get(server.link, headers={"Accept": "text/html"}, timeout=10)
        assert landing.status_code == 200
        set_cookie = landing.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and "Path=/" in set_cookie
        assert 'http-equiv="refresh" content="0; url=/"' in landing.text, "forwards to the clean URL"
        assert server.token not in landing.text
        assert landing.headers["Referrer-Policy"] == "no-referrer"
        assert landing.headers["X-Frame-Options"] == "DENY"
        cookie = server.sign_in()

        page = httpx.get(server.base + "/", cookies={cookie_name(server.port): cookie}, timeout=10)
        assert page.status_code == 200 and f"ws://127.0.0.1:{server.port}/ws" in page.text
        with server.websocket(cookie=cookie) as ws:
            app_output(ws)
            assert len(server.app_processes()) == 1
        wait_for("the app to quit with its tab", lambda: server.app_processes() == [])

        # scripts may send the token instead of the cookie (the Origin is still checked)
        with server.websocket(query=f"&token={server.token}") as ws:
            app_output(ws)


def test_forged_cookies_and_tokens_are_refused(tmp_path: Path) -> None:
    control = "c" * 43
    with serve(tmp_path, control_token=control) as server, serve(tmp_path / "other") as other:
        assert refused(lambda: server.websocket(cookie="forged-" + "x" * 36))[0] == 403
        stale = other.sign_in()  # a real cookie, of another server start
        assert refused(lambda: server.websocket(cookie=stale))[0] == 403
        assert httpx.get(server.base + "/?token=" + "y" * 43, timeout=10).status_code == 403
        assert httpx.get(server.base + "/?token=", timeout=10).status_code == 403
        assert server.app_processes() == []
        # the agent's control token is the same secret as the link's: it signs in too
        landing = httpx.get(f"{server.base}/?token={control}", timeout=10)
        assert landing.status_code == 200 and cookie_name(server.port) in landing.headers["set-cookie"]


# ----------------------------------------------------------------------------------------- hosts, origins
def test_a_rebound_host_is_refused_even_with_allow_remote(tmp_path: Path) -> None:
    with serve(tmp_path, allow_remote=True, allowed_hosts=("volunteers.example.org",)) as server:
        rebound = {"Host": f"attacker.example:{server.port}"}
        page = httpx.get(server.link, headers=rebound, timeout=10)  # even with the token
        assert page.status_code == 403 and page.json()["error"] == "forbidden_host"
        cookie = server.sign_in()
        status, body = refused(
            lambda: server.websocket(
                cookie=cookie, origin=f"http://attacker.example:{server.port}", host="attacker.example"
            )
        )
        assert (status, body["error"]) == (403, "forbidden_host")
        assert server.app_processes() == []
        # a name the volunteer configured is answered
        proxied = httpx.get(
            server.link, headers={"Host": f"volunteers.example.org:{server.port}"}, timeout=10
        )
        assert proxied.status_code == 200


def test_a_page_of_another_origin_cannot_open_the_app(tmp_path: Path) -> None:
    with serve(tmp_path) as server:
        cookie = server.sign_in()  # cookies are not separated by port: another port's page sends it too
        for origin in (f"http://127.0.0.1:{server.port + 1}", "http://attacker.example", "null"):
            status, body = refused(functools.partial(server.websocket, cookie=cookie, origin=origin))
            assert (status, body["error"]) == (403, "forbidden_origin"), origin
        assert server.app_processes() == []


# ----------------------------------------------------------------------------------------- the cap
def test_the_session_cap_refuses_the_extra_tab(tmp_path: Path) -> None:
    with serve(tmp_path, max_sessions=2) as server:
        cookie = server.sign_in()
        with server.websocket(cookie=cookie) as first, server.websocket(cookie=cookie) as second:
            app_output(first)
            app_output(second)
            assert len(server.app_processes()) == 2
            status, body = refused(lambda: server.websocket(cookie=cookie))
            assert (status, body["error"]) == (503, "too_many_sessions")
            assert len(server.app_processes()) == 2, "the refused tab must not start an app"
            server.read_lines()
            assert any("refused a browser tab: 2 already run the app" in line for line in server.lines)
            first.close()
            wait_for("the first tab's app to quit", lambda: len(server.app_processes()) == 1)
            with server.websocket(cookie=cookie) as third:  # a closed tab frees its slot
                app_output(third)
                assert len(server.app_processes()) == 2


# ----------------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize(
    ("listen", "header", "allowed"),
    [
        ("127.0.0.1", "127.0.0.1:8000", True),
        ("127.0.0.1", "localhost:8000", True),
        ("127.0.0.1", "[::1]:8000", True),
        ("127.0.0.1", "LOCALHOST:8000", True),
        ("127.0.0.1", "127.0.0.1:8001", False),
        ("127.0.0.1", "127.0.0.1", False),
        ("127.0.0.1", "attacker.example:8000", False),
        ("127.0.0.1", "10.0.0.5:8000", False),
        ("127.0.0.1", "", False),
        ("127.0.0.1", "127.0.0.1:8000:1", False),
        ("0.0.0.0", "192.168.1.5:8000", True),
        ("0.0.0.0", "localhost:8000", True),
        ("0.0.0.0", "attacker.example:8000", False),
        ("0.0.0.0", "192.168.1.6:8000", False),
        ("192.168.1.5", "192.168.1.5:8000", True),
        ("192.168.1.5", "localhost:8000", False),
        ("192.168.1.5", "volunteers.example.org", True),
        ("192.168.1.5", "volunteers.example.org:443", True),
        ("192.168.1.5", "only-here.example.org:8000", True),
        ("192.168.1.5", "only-here.example.org:9000", False),
    ],
)
def test_the_host_rules(listen: str, header: str, allowed: bool) -> None:
    rules = host_rules(
        listen,
        8000,
        ["volunteers.example.org", "only-here.example.org:8000"],
        own_addresses={"192.168.1.5", "127.0.0.1"},
    )
    assert rules.allows(header) is allowed


def test_host_parts_and_origins() -> None:
    assert split_host("[::1]:80") == ("::1", 80)
    assert split_host("Example.org.") == ("example.org", None)
    assert split_host("example.org:x") is None and split_host("[::1") is None
    assert same_origin("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert not same_origin("http://127.0.0.1:8001", "127.0.0.1:8000")
    assert not same_origin(None, "127.0.0.1:8000") and not same_origin("null", "127.0.0.1:8000")
    with pytest.raises(ValueError, match="not a host name"):
        host_rules("127.0.0.1", 8000, ["bad host:x"])


def test_the_browser_is_opened_through_a_private_file(tmp_path: Path) -> None:
    """``open_browser`` starts the browser with a file, not the link: command lines are public (``ps``)."""
    link = "http://127.0.0.1:8000/?token=s3cret"
    page = forwarding_file(link, tmp_path)
    assert stat.S_IMODE(page.stat().st_mode) == 0o600
    assert f'content="0; url={link}"' in page.read_text() and "s3cret" not in page.as_uri()


# ----------------------------------------------------------------------------------------- in Chromium
@contextlib.contextmanager
def other_site(page_html: str) -> Iterator[str]:
    """A page served on another port of loopback (what another user of this computer can serve)."""
    body = page_html.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.browser
def test_in_chromium_only_the_login_link_opens_the_app(tmp_path: Path, browser: Browser) -> None:
    with serve(tmp_path / "served") as server:
        stranger = browser.new_page()  # a browser that never saw the link
        response = stranger.goto(server.base + "/")
        assert response is not None and response.status == 403
        assert "Open the link that volunteer-app web printed" in stranger.content()
        assert server.app_processes() == []

        # what `open_browser` does: a private file that forwards to the link
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        received: list[bytes] = []
        context = browser.new_context()
        page = context.new_page()
        page.on(
            "websocket",
            lambda ws: ws.on("framereceived", lambda f: received.append(f if isinstance(f, bytes) else b"")),
        )
        page.goto(forwarding_file(server.link, private).as_uri())
        deadline = time.monotonic() + 60
        while b"mini app ready" not in b"".join(received):
            assert time.monotonic() < deadline, f"the app never showed; the page is at {page.url}"
            page.wait_for_timeout(100)
        assert page.url == server.base + "/", "the link forwards to the clean URL"
        assert page.evaluate("document.cookie") == "", "the session cookie is HttpOnly"
        assert len(server.app_processes()) == 1

        # another port's page in the same browser: the cookie goes along (same site), the Origin does not match
        attack = f"""<script>
            const ws = new WebSocket("ws://127.0.0.1:{server.port}/ws");
            ws.onopen = () => {{ document.title = "opened"; }};
            ws.onclose = () => {{ if (document.title !== "opened") document.title = "refused"; }};
        </script>"""
        with other_site(attack) as url:
            other = context.new_page()
            other.goto(url)
            other.wait_for_function("document.title !== ''", timeout=30_000)
            assert other.title() == "refused"
        assert len(server.app_processes()) == 1, "the other page's websocket must not start an app"
