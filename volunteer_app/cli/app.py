"""The app: ``volunteer-app`` with no command opens it in the terminal (Textual), ``volunteer-app web`` serves
it to a browser on this computer. Either way it attaches to the agent (started in the background first if
none runs) and never hosts it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from volunteer_app.cli.agent import ensure_agent, start_background_agent
from volunteer_app.cli.common import PROG, add_config_dir, agent_settings
from volunteer_app.cliutil import UsageError, UserError

WEB_PORT = 8471


def add_parsers(commands: Any) -> None:
    web = commands.add_parser(
        "web",
        help="open the app in a browser on this computer",
        description="Serve the same app as `volunteer-app` to a local browser (textual-serve): each browser tab "
        "is its own app attached to the agent, which is started in the background if none runs. Loopback only "
        "unless --host and --allow-remote say otherwise.",
    )
    # own dest names: `--host`/`--port`/`--allow-remote` of `agent` configure the agent's control API
    web.add_argument(
        "--port",
        dest="web_port",
        metavar="PORT",
        type=int,
        default=WEB_PORT,
        help=f"port to serve on (default {WEB_PORT}; 0: any free)",
    )
    web.add_argument(
        "--host",
        dest="web_host",
        metavar="HOST",
        default="127.0.0.1",
        help="address to serve on (default 127.0.0.1)",
    )
    web.add_argument(
        "--allow-remote",
        dest="web_allow_remote",
        action="store_true",
        help="let --host be an address other computers reach (they still need the login link it prints)",
    )
    web.add_argument(
        "--allowed-host",
        dest="web_allowed_hosts",
        metavar="NAME",
        action="append",
        default=[],
        help="also answer requests for this host name (NAME or NAME:PORT, e.g. a reverse proxy's); repeatable",
    )
    web.add_argument(
        "--max-sessions",
        dest="web_max_sessions",
        metavar="N",
        type=int,
        default=None,
        help="browser tabs (app processes, ~70 MB each) at once (default 4)",
    )
    web.add_argument("--no-open", action="store_true", help="do not open the browser")
    web.add_argument(
        "--coordinator",
        dest="app_coordinator",
        default=None,
        metavar="URL",
        help="preselect this coordinator",
    )
    add_config_dir(web)

    web.set_defaults(handler=run_web)


def run_app(args: argparse.Namespace) -> int:
    """No command: the app (Textual), attached to the running agent or to one started in the background."""
    web_driver = bool(os.environ.get("TEXTUAL_DRIVER"))  # a browser tab of `volunteer-app web`
    if not web_driver and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            f"{PROG} without a command opens the terminal app and needs a terminal; see `{PROG} --help` for the "
            "shell commands (status, join, ...)"
        )
    settings = agent_settings(args)
    notices: list[str] = []
    ensure_agent(settings, args, say=notices.append)
    if not web_driver:
        for notice in notices:
            print(notice, flush=True)
    from tui.app import VolunteerApp

    app = VolunteerApp(
        settings=settings,
        start_agent=lambda: start_background_agent(settings, args),
        coordinator=args.app_coordinator,
        notice=" ".join(notices) or None,
    )
    message = app.run()
    if message and not web_driver:
        print(message)
    return app.return_code or 0


def run_web(args: argparse.Namespace) -> int:
    """``web``: the app in a browser, served on this computer behind a one-time login link."""
    from tui.web import DEFAULT_MAX_SESSIONS, is_loopback, serve_web

    if not is_loopback(args.web_host) and not args.web_allow_remote:
        raise UsageError(
            f"{PROG} web: --host {args.web_host} would let other computers reach the page that steers your agent "
            "(with the login link it prints); add --allow-remote if that is what you want"
        )
    if not 0 <= args.web_port <= 65535:
        raise UsageError(f"{PROG} web: --port must be between 0 and 65535")
    max_sessions = DEFAULT_MAX_SESSIONS if args.web_max_sessions is None else args.web_max_sessions
    if max_sessions < 1:
        raise UsageError(f"{PROG} web: --max-sessions must be at least 1")
    settings = agent_settings(args)
    if args.config_dir is not None:
        os.environ["VOLUNTEER_CONFIG_DIR"] = str(settings.config_dir)  # for each tab's app process
    ensure_agent(settings, args, say=print)
    try:
        serve_web(
            host=args.web_host, port=args.web_port, allow_remote=args.web_allow_remote, open_browser=not args.no_open,
            coordinator=args.app_coordinator, say=lambda text: print(text, flush=True),
            max_sessions=max_sessions, allowed_hosts=args.web_allowed_hosts, settings=settings,
        )  # fmt: skip
    except OSError as exc:
        raise UserError(
            f"cannot serve on {args.web_host}:{args.web_port}: {exc.strerror or exc}; try another --port"
        ) from exc
    return 0
