"""What the command groups share: the program's name, the agent's settings from the arguments, where the
running agent is, and how a command's answer is printed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from volunteer_app.cliutil import UserError
from volunteer_app.control_client import AgentAddress, AgentNotRunning, locate_agent
from volunteer_app.safetext import clean
from volunteer_app.settings import AgentSettings

PROG = "volunteer-app"


def add_config_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-dir", type=Path, default=None, help="where the credential, keys, settings and logs live"
    )


def add_network(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen-host", default=None, help="address the swarm peer listens on (default 0.0.0.0)"
    )
    parser.add_argument(
        "--announce-host", default=None, help="public address to announce when ports are forwarded"
    )
    parser.add_argument(
        "--no-incoming", action="store_true", help="this machine cannot accept connections (client mode)"
    )


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    overrides = {
        "config_dir": getattr(args, "config_dir", None),
        "coordinator": getattr(args, "coordinator", None),
        "run": getattr(args, "run", None),
        "name": getattr(args, "name", None),
        "invite_code": getattr(args, "invite_code", None),
        "max_threads": getattr(args, "max_threads", None),
        "max_memory_gb": getattr(args, "max_memory", None),
        "device": getattr(args, "device", None),
        "listen_host": getattr(args, "listen_host", None),
        "announce_host": getattr(args, "announce_host", None),
        "accepts_connections": False if getattr(args, "no_incoming", False) else None,
        "control_host": getattr(args, "host", None),
        "control_port": getattr(args, "port", None),
    }
    return AgentSettings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]


def agent_address(args: argparse.Namespace) -> AgentAddress:
    """The running agent's address, or a :class:`UserError` that says how to start one."""
    try:
        return locate_agent(agent_settings(args))
    except AgentNotRunning as exc:
        raise UserError(str(exc)) from exc


def print_result(result: Any, args: argparse.Namespace) -> None:
    """A command's answer: its JSON with ``--json``, else its message (as text: it may quote a coordinator)."""
    if args.json:
        print(json.dumps(result.model_dump(mode="json")))
    else:
        print(clean(result.message))
