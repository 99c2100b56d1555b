"""The one-shot commands that watch and steer the running agent: ``status``, ``pause``, ``resume``,
``finish``, ``snooze``, ``leave``, ``stop`` and ``settings show|set`` (which also works on the settings
file when no agent runs). Each prints one line, or the agent's JSON answer with ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from volunteer_app.agentfiles import agent_running, load_policy, save_policy
from volunteer_app.cli.common import PROG, add_config_dir, agent_address, agent_settings, print_result
from volunteer_app.cliutil import ArgumentParser, UsageError, UserError
from volunteer_app.control import PolicySettings, parse_duration, parse_setting, validation_problems
from volunteer_app.control_client import AgentNotRunning, ControlError, get_state, locate_agent, send_command
from volunteer_app.safetext import clean, one_line

if TYPE_CHECKING:
    from volunteer_app.control_client import AgentAddress


def add_parsers(commands: Any) -> None:
    for name, text in (
        ("status", "show what the agent is doing"),
        ("pause", "pause training (accumulated work is kept)"),
        ("resume", "resume after pause, snooze or finish"),
        ("finish", "complete the current lease, report it, then pause"),
        ("leave", "leave the run (leases are returned); the agent stays"),
        ("stop", "leave the run, then end the agent"),
    ):
        sub = commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        sub.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
        add_config_dir(sub)
        sub.set_defaults(handler={"status": run_status, "stop": run_stop}.get(name) or command(name))
    snooze = commands.add_parser(
        "snooze",
        help="pause for a while, e.g. `snooze 2h`",
        description="Pause now and resume by itself later.",
    )
    snooze.add_argument("duration", help="how long: 30m, 2h, 1h30m, 1d or seconds")
    snooze.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    add_config_dir(snooze)
    snooze.set_defaults(handler=command("snooze", snooze_params))

    settings = commands.add_parser(
        "settings",
        help="show or change when and how much this machine computes",
        description="Show or change the agent's settings (threads, GPU, memory, idle, battery, schedule, "
        "temperature...). Changes apply at once; the answer says when one needs a worker restart. Without a "
        "running agent, the settings file is read or written directly.",
    )
    settings.set_defaults(handler=run_settings)
    settings_commands = settings.add_subparsers(
        dest="settings_command", metavar="ACTION", parser_class=ArgumentParser
    )
    show = settings_commands.add_parser("show", help="list every setting with its value")
    show.add_argument("--json", action="store_true", help="print the settings as JSON")
    add_config_dir(show)
    set_ = settings_commands.add_parser("set", help="change one setting: settings set KEY VALUE")
    set_.add_argument("key", help="the setting, e.g. max_threads, schedule, pause_on_battery")
    set_.add_argument("value", help="its value; 'none' clears an optional one; lists take 'a; b'")
    set_.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    add_config_dir(set_)


def command(name: str, params: Any = None) -> Any:
    """The handler of a command that the agent answers in one line (``pause``, ``resume``...): ``params``
    are its parameters, or a function of the arguments that gives them."""

    def handler(args: argparse.Namespace) -> int:
        try:
            result = send_command(agent_address(args), name, params(args) if callable(params) else params)
        except ControlError as exc:
            raise UserError(exc.detail) from exc
        print_result(result, args)
        return 0

    return handler


STOP_WAIT_SECONDS = 30.0


def run_stop(args: argparse.Namespace) -> int:
    """``stop``: the agent leaves its run and ends; this waits until it has (and says so)."""
    settings = agent_settings(args)
    address = agent_address(args)
    try:
        result = send_command(address, "stop")
    except ControlError as exc:
        raise UserError(exc.detail) from exc
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while agent_running(settings) and time.monotonic() < deadline:
        time.sleep(0.2)
    if agent_running(settings):
        raise UserError(
            f"the agent (pid {address.pid or '?'}) said it stops but is still running after "
            f"{STOP_WAIT_SECONDS:.0f} s; see {settings.agent_log_path}"
        )
    if args.json:
        print(json.dumps({**result.model_dump(mode="json"), "stopped": True}))
    else:
        print(clean(result.message))
        print("the agent has stopped")
    return 0


def snooze_params(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return {"seconds": parse_duration(args.duration)}
    except ValueError as exc:
        raise UsageError(f"{PROG} snooze: {exc}") from exc


def describe_state(state: Any) -> str:
    """One line about the agent: what it does, for whom, how fast, and why it is paused (coordinator text in
    it is shown as text: :func:`volunteer_app.safetext.one_line`)."""
    return one_line(_describe_state(state))


def _describe_state(state: Any) -> str:
    c = state.contribution
    if c is None or c.state in ("stopped", "failed"):
        ended = ""
        if c is not None:
            ended = f"; last run {c.run}: {c.stop_reason or c.last_error or c.state}"
        return f"idle: not contributing to any run{ended}"
    what = "paused" if c.pause_reasons else c.state
    line = f"{what}: run {c.run} at {c.coordinator} as {c.name}"
    if c.pause_reasons:
        line += f" ({'; '.join(c.pause_reasons)})"
    if c.samples_total:
        loss = f", loss {c.loss:.3f}" if c.loss is not None else ""
        line += (
            f"; {c.samples_total} samples, {c.samples_per_second:.0f}/s{loss}, epoch {c.local_epoch}/{c.global_epoch}, "
            f"swarm of {c.swarm_size}, credited {c.samples_credited}"
        )
    if c.reachability:
        line += f"; {c.reachability}" + (f" ({c.reachability_reason})" if c.reachability_reason else "")
    if c.isolated:
        line += f"; this worker {c.isolated}"
    if not c.coordinator_ok:
        line += "; the coordinator is unreachable (reports wait in the outbox)"
    return line


def run_status(args: argparse.Namespace) -> int:
    try:
        state = get_state(agent_address(args))
    except ControlError as exc:
        raise UserError(exc.detail) from exc
    if args.json:
        print(state.model_dump_json())
    else:
        print(describe_state(state))
    return 0


def run_settings(args: argparse.Namespace) -> int:
    """``settings show|set``: through the agent when one runs, else on the settings file itself."""
    if args.settings_command is None:
        args.settings_command, args.json = "show", getattr(args, "json", False)
    settings = agent_settings(args)
    try:
        address: AgentAddress | None = locate_agent(settings)
    except AgentNotRunning:
        address = None
    if args.settings_command == "show":
        if address is not None:
            try:
                policy = get_state(address).settings
            except ControlError as exc:
                raise UserError(exc.detail) from exc
        else:
            policy, problem = load_policy(settings)
            if problem:
                print(f"warning: {problem}", file=sys.stderr)
        if args.json:
            print(policy.model_dump_json(indent=2))
            return 0
        for key, field in PolicySettings.model_fields.items():
            value = getattr(policy, key)
            shown = (
                "none"
                if value is None
                else ("; ".join(value) or "(empty)")
                if isinstance(value, list)
                else value
            )
            print(f"{key:<28} {shown!s:<22} {field.description}")
        return 0
    try:
        value = parse_setting(args.key, args.value)
    except ValueError as exc:
        raise UsageError(f"{PROG} settings set: {exc}") from exc
    if address is not None:
        try:
            result = send_command(address, "settings", {args.key: args.value})
        except ControlError as exc:
            raise UserError(exc.detail) from exc
        print_result(result, args)
        return 0
    policy, _problem = load_policy(settings)
    try:
        updated = PolicySettings.model_validate({**policy.model_dump(), args.key: value})
    except ValidationError as exc:
        raise UserError(validation_problems(exc)) from exc
    save_policy(settings, updated)
    message = f"{args.key} = {getattr(updated, args.key)!r} (saved; the agent is not running, it applies when it starts)"
    print(
        json.dumps({"message": message, "settings": updated.model_dump(mode="json")})
        if args.json
        else message
    )
    return 0
