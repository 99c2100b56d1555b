"""``volunteer-app agent``: the agent service, in this process or started in the background, and what every
command that needs an agent uses to find one or start it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from volunteer_app import __version__
from volunteer_app.agentfiles import read_location
from volunteer_app.cli.common import add_config_dir, add_network, agent_settings
from volunteer_app.cliutil import UserError
from volunteer_app.control_client import AgentNotRunning, locate_agent

if TYPE_CHECKING:
    from volunteer_app.control_client import AgentAddress
    from volunteer_app.settings import AgentSettings

AGENT_START_TIMEOUT = 60.0


def add_parsers(commands: Any) -> None:
    agent = commands.add_parser(
        "agent",
        help="run the agent service (the other commands start it when needed)",
        description="Run the volunteer agent: it owns this machine's contribution, applies your settings "
        "(when to compute, how much) and answers the terminal UI and the shell commands on a local control "
        "API. One agent per user: a second one says where the first is.",
    )
    agent.add_argument("--background", action="store_true", help="detach; return once the agent answers")
    agent.add_argument("--host", default=None, help="control API address (default 127.0.0.1)")
    agent.add_argument("--port", type=int, default=None, help="control API port (default: any free port)")
    agent.add_argument(
        "--allow-remote",
        action="store_true",
        help="let the control API listen beyond this computer (token still required)",
    )
    add_network(agent)
    add_config_dir(agent)
    agent.set_defaults(handler=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    """``agent``: run the agent service here, or start it in the background."""
    settings = agent_settings(args)
    if args.background:
        location = read_location(settings)
        if location is not None:
            print(f"an agent is already running (pid {location.get('pid', '?')}, {location.get('url', '?')})")
            return 0
        address = start_background_agent(settings, args)
        print(
            f"the agent runs in the background (pid {address.pid}, {address.url}); log: {settings.agent_log_path}"
        )
        return 0
    from volunteer_app.agent import serve_agent

    log_agent_messages()

    def ready(url: str) -> None:
        print(
            f"agent {__version__} listening at {url} (pid {os.getpid()}); config in {settings.config_dir}",
            flush=True,
        )

    asyncio.run(serve_agent(settings, allow_remote=args.allow_remote, on_ready=ready))
    print("agent stopped", flush=True)
    return 0


def log_agent_messages() -> None:
    """The agent's messages (joined, leases credited, worker restarts, refusals) as timestamped lines on
    stderr: the terminal of a foreground agent, the agent log of a background one. Only the app's own
    loggers speak at INFO; libraries (httpx logs every request at INFO) keep to warnings."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("volunteer_app").setLevel(logging.INFO)


def _agent_argv(settings: AgentSettings, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "volunteer_app.cli", "agent", "--config-dir", str(settings.config_dir)]
    for flag, value in (
        ("--listen-host", getattr(args, "listen_host", None)),
        ("--announce-host", getattr(args, "announce_host", None)),
        ("--host", getattr(args, "host", None)),
        ("--port", getattr(args, "port", None)),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if getattr(args, "no_incoming", False):
        argv.append("--no-incoming")
    if getattr(args, "allow_remote", False):
        argv.append("--allow-remote")
    return argv


def start_background_agent(settings: AgentSettings, args: argparse.Namespace) -> AgentAddress:
    """Start ``volunteer-app agent`` detached (its own session, output to the agent log) and wait until it
    answers. Raises :class:`UserError` with the log's last lines when it does not come up."""
    import httpx

    log_path = settings.agent_log_path
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            _agent_argv(settings, args), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    deadline = time.monotonic() + AGENT_START_TIMEOUT
    while time.monotonic() < deadline:
        code = process.poll()
        try:
            address = locate_agent(settings)
            if httpx.get(f"{address.url}/api/v1/health", timeout=2).status_code == 200:
                return address
        except (AgentNotRunning, httpx.HTTPError):
            pass
        if code is not None:
            # another agent may have won the race for the lock: use it
            try:
                return locate_agent(settings)
            except AgentNotRunning:
                break
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path.exists() else []
    raise UserError(f"the agent did not start ({' / '.join(tail) or 'no output'}); see {log_path}")


def ensure_agent(settings: AgentSettings, args: argparse.Namespace, *, say: Any) -> AgentAddress:
    """The running agent's address; starts one in the background first when none runs (and says so)."""
    try:
        return locate_agent(settings)
    except AgentNotRunning:
        pass
    address = start_background_agent(settings, args)
    say(
        f"started the agent in the background (pid {address.pid}); it keeps contributing after this command "
        "ends: `volunteer-app status` shows it, `volunteer-app stop` ends it"
    )
    return address
