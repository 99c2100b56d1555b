"""``volunteer-app``: contribute your computer to a collaborative training run.

The work happens in the agent service (``volunteer-app agent``), one per user, which keeps training in
the background; every other command attaches to it: ``join`` starts it when none runs and follows the
contribution, ``status``/``pause``/``resume``/``finish``/``snooze``/``leave``/``stop`` and ``settings``
steer it and print one line (or ``--json``). ``join --foreground`` runs everything in this one process
(containers, scripts that want Ctrl-C to end the contribution).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from volunteer_app import __version__
from volunteer_app.cliutil import ArgumentParser, UsageError, UserError, run_main
from volunteer_app.profile import describe, profile_machine
from volunteer_app.safetext import clean, one_line

if TYPE_CHECKING:
    from volunteer_app.control_client import AgentAddress
    from volunteer_app.demo import DemoOptions
    from volunteer_app.settings import AgentSettings

PROG = "volunteer-app"
AGENT_START_TIMEOUT = 60.0
WEB_PORT = 8471


# ----------------------------------------------------------------------------------------- parser
def _add_config_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-dir", type=Path, default=None, help="where the credential, keys, settings and logs live"
    )


def _add_network(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen-host", default=None, help="address the swarm peer listens on (default 0.0.0.0)"
    )
    parser.add_argument(
        "--announce-host", default=None, help="public address to announce when ports are forwarded"
    )
    parser.add_argument(
        "--no-incoming", action="store_true", help="this machine cannot accept connections (client mode)"
    )


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Lend your computer to a research group's collaborative training run (peer to peer,\n"
        "with hivemind). A background agent does the work; these commands start, watch and steer it.\n"
        "Without a command, the terminal app opens (it starts the agent if none is running).",
        epilog="examples:\n"
        "  volunteer-app                                   open the terminal app\n"
        "  volunteer-app demo                              train a local swarm for about 5 minutes\n"
        "  volunteer-app join --coordinator URL --run RUN  contribute to a run (the agent keeps going)\n"
        "  volunteer-app status | pause | resume | leave   watch and steer the agent\n"
        "  volunteer-app web                               the same app in your browser",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--coordinator",
        dest="app_coordinator",
        default=None,
        metavar="URL",
        help="without a command: open the app with this coordinator preselected for joining a run",
    )
    commands = parser.add_subparsers(dest="command", metavar="[COMMAND]", parser_class=ArgumentParser)

    profile = commands.add_parser("profile", help="show this machine's hardware profile (CPU, memory, GPUs)")
    profile.add_argument("--json", action="store_true", help="print the profile as JSON")
    profile.add_argument(
        "--task", default=None, help="also measure training speed on this task (e.g. shapes-dalle)"
    )
    profile.add_argument(
        "--seconds", type=float, default=4.0, help="length of the speed measurement (default 4)"
    )

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
    _add_network(agent)
    _add_config_dir(agent)

    join = commands.add_parser(
        "join",
        help="contribute to a run and follow it (headless, for servers and scripts)",
        description="Register (once), profile this machine, join the run and follow the training. The agent "
        "service does the work (it is started in the background if none runs) and keeps training after this "
        "command ends; Ctrl-C detaches. With --foreground everything runs in this process and Ctrl-C leaves. "
        "Settings can also come from VOLUNTEER_* environment variables.",
    )
    join.add_argument(
        "--coordinator", default=None, metavar="URL", help="the coordinator's URL (env VOLUNTEER_COORDINATOR)"
    )
    join.add_argument(
        "--run", default=None, metavar="NAME", help="the run to contribute to (env VOLUNTEER_RUN)"
    )
    join.add_argument("--name", default=None, help="your public name on the leaderboard (default: user-host)")
    join.add_argument("--invite-code", default=None, help="invite code of an invite-only run")
    join.add_argument(
        "--max-threads",
        type=int,
        default=None,
        metavar="N",
        help="most CPU threads to use (default: all cores)",
    )
    join.add_argument(
        "--max-memory",
        type=float,
        default=None,
        metavar="GB",
        help="memory cap; the micro-batch shrinks to fit",
    )
    join.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="train on the GPU or the CPU (default auto)",
    )
    join.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="leave after this long (default: never)",
    )
    join.add_argument(
        "--samples", type=int, default=None, metavar="N", help="leave after training this many samples"
    )
    join.add_argument(
        "--evaluate", action="store_true", help="evaluate the shared model on held-out data before leaving"
    )
    join.add_argument(
        "--foreground", action="store_true", help="run in this process only; Ctrl-C leaves the run"
    )
    _add_network(join)
    _add_config_dir(join)
    join.add_argument(
        "--json", action="store_true", help="print JSON lines (messages, status every 5 s, summary)"
    )

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
        _add_config_dir(sub)
    snooze = commands.add_parser(
        "snooze",
        help="pause for a while, e.g. `snooze 2h`",
        description="Pause now and resume by itself later.",
    )
    snooze.add_argument("duration", help="how long: 30m, 2h, 1h30m, 1d or seconds")
    snooze.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    _add_config_dir(snooze)

    settings = commands.add_parser(
        "settings",
        help="show or change when and how much this machine computes",
        description="Show or change the agent's settings (threads, GPU, memory, idle, battery, schedule, "
        "temperature...). Changes apply at once; the answer says when one needs a worker restart. Without a "
        "running agent, the settings file is read or written directly.",
    )
    settings_commands = settings.add_subparsers(
        dest="settings_command", metavar="ACTION", parser_class=ArgumentParser
    )
    show = settings_commands.add_parser("show", help="list every setting with its value")
    show.add_argument("--json", action="store_true", help="print the settings as JSON")
    _add_config_dir(show)
    set_ = settings_commands.add_parser("set", help="change one setting: settings set KEY VALUE")
    set_.add_argument("key", help="the setting, e.g. max_threads, schedule, pause_on_battery")
    set_.add_argument("value", help="its value; 'none' clears an optional one; lists take 'a; b'")
    set_.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    _add_config_dir(set_)

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
    _add_config_dir(web)

    # Defaults left as None are DemoOptions' (volunteer_app.demo, imported only when the demo runs).
    demo = commands.add_parser(
        "demo",
        help="run a whole local swarm: a coordinator and N peers training shapes-dalle together",
        description="Starts a coordinator on loopback with a temporary data dir, creates a shapes-dalle run and "
        "runs N peers that train it together, then prints a summary and the model's drawings of fixed "
        "captions (in the terminal and as a PNG). The defaults take about 5 minutes; the longer the "
        "training, the better the drawings (on 2 CPU cores the default draws nearly every caption right).",
    )
    demo.add_argument("--peers", type=int, default=None, help="local peers (default 2)")
    demo.add_argument(
        "--duration", type=float, default=None, metavar="SECONDS", help="training time (default 270)"
    )
    demo.add_argument(
        "--headless",
        action="store_true",
        help="plain progress lines instead of the live panel (for logs and terminals that cannot redraw)",
    )
    demo.add_argument(
        "--verbose",
        action="store_true",
        help="show every peer message, a line per credited lease included (they are always in demo.log and "
        "--json)",
    )
    demo.add_argument("--json", action="store_true", help="JSON lines, ending with a summary line")
    demo.add_argument(
        "--preset",
        default=None,
        choices=["mini", "tiny", "base"],
        help="model size (default mini, the fastest to learn; tiny is the runs' default)",
    )
    demo.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help="samples between parameter averaging rounds (default: the coordinator's, 2048)",
    )
    demo.add_argument("--threads", type=int, default=None, help="threads per peer (default: cores / peers)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    return parser


# ----------------------------------------------------------------------------------------- profile
def _cmd_profile(args: argparse.Namespace) -> int:
    profile = profile_machine()
    if args.task:
        from volunteer_app.agent.speedtest import RunRefused, SpeedTestCache, measure_speed
        from volunteer_app.protocol import OptimizerSettings, RunOut, RunStats
        from volunteer_app.settings import AgentSettings

        run = RunOut(
            name="profile", task=args.task, description="", state="active", visibility="open", created_at=0,
            data_epochs=1, task_config={}, optimizer=OptimizerSettings(), stats=RunStats(),
        )  # fmt: skip
        settings = AgentSettings()
        try:
            benchmark = asyncio.run(
                measure_speed(
                    run=run, profile=profile, cache=SpeedTestCache(settings.config_dir / "benchmarks.json"),
                    seconds=args.seconds, max_threads=None, device="auto", work_dir=settings.work_dir,
                    on_message=lambda text: print(text, file=sys.stderr), refresh=True,
                )
            )  # fmt: skip
        except RunRefused as exc:
            raise UserError(f"cannot measure task {args.task!r}: {exc}") from exc
        if benchmark is None:
            raise UserError(f"could not measure the speed of task {args.task!r}")
        profile = profile.model_copy(update={"benchmark": benchmark})
    if args.json:
        print(json.dumps(profile.model_dump(mode="json"), indent=2))
    else:
        print("\n".join(describe(profile)))
    return 0


# ----------------------------------------------------------------------------------------- settings
def _agent_settings(args: argparse.Namespace) -> AgentSettings:
    from volunteer_app.settings import AgentSettings

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


# ----------------------------------------------------------------------------------------- agent
def _cmd_agent(args: argparse.Namespace) -> int:
    from volunteer_app.agent.service import read_location

    settings = _agent_settings(args)
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

    _log_agent_messages()

    def ready(url: str) -> None:
        print(
            f"agent {__version__} listening at {url} (pid {os.getpid()}); config in {settings.config_dir}",
            flush=True,
        )

    asyncio.run(serve_agent(settings, allow_remote=args.allow_remote, on_ready=ready))
    print("agent stopped", flush=True)
    return 0


def _log_agent_messages() -> None:
    """The agent's messages (joined, leases credited, worker restarts, refusals) as timestamped lines on
    stderr: the terminal of a foreground agent, the agent log of a background one. Only the app's own
    loggers speak at INFO; libraries (httpx logs every request at INFO) keep to warnings."""
    import logging

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

    from volunteer_app.control_client import AgentNotRunning, locate_agent

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
    from volunteer_app.control_client import AgentNotRunning, locate_agent

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


# ----------------------------------------------------------------------------------------- one-shot commands
def _address(args: argparse.Namespace) -> AgentAddress:
    from volunteer_app.control_client import AgentNotRunning, locate_agent

    try:
        return locate_agent(_agent_settings(args))
    except AgentNotRunning as exc:
        raise UserError(str(exc)) from exc


def _print_result(result: Any, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(result.model_dump(mode="json")))
    else:
        print(clean(result.message))


def _command(name: str, params: dict[str, Any] | None = None) -> Any:
    def handler(args: argparse.Namespace) -> int:
        from volunteer_app.control_client import ControlError, send_command

        try:
            result = send_command(_address(args), name, params(args) if callable(params) else params)
        except ControlError as exc:
            raise UserError(exc.detail) from exc
        _print_result(result, args)
        return 0

    return handler


STOP_WAIT_SECONDS = 30.0


def _cmd_stop(args: argparse.Namespace) -> int:
    """``stop``: the agent leaves its run and ends; this waits until it has (and says so)."""
    from volunteer_app.agent.service import agent_running
    from volunteer_app.control_client import ControlError, send_command

    settings = _agent_settings(args)
    address = _address(args)
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


def _snooze_params(args: argparse.Namespace) -> dict[str, Any]:
    from volunteer_app.control import parse_duration

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
    if not c.coordinator_ok:
        line += "; the coordinator is unreachable (reports wait in the outbox)"
    return line


def _cmd_status(args: argparse.Namespace) -> int:
    from volunteer_app.control_client import ControlError, get_state

    try:
        state = get_state(_address(args))
    except ControlError as exc:
        raise UserError(exc.detail) from exc
    if args.json:
        print(state.model_dump_json())
    else:
        print(describe_state(state))
    return 0


def _cmd_settings(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from volunteer_app.agent.service import load_policy, save_policy
    from volunteer_app.control import PolicySettings, parse_setting, validation_problems
    from volunteer_app.control_client import (
        AgentNotRunning,
        ControlError,
        get_state,
        locate_agent,
        send_command,
    )

    if args.settings_command is None:
        args.settings_command, args.json = "show", getattr(args, "json", False)
    settings = _agent_settings(args)
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
        _print_result(result, args)
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


# ----------------------------------------------------------------------------------------- join
def _cmd_join(args: argparse.Namespace) -> int:
    from volunteer_app.display import JsonLines, LiveDisplay

    settings = _agent_settings(args)
    if not settings.coordinator:
        raise UsageError(f"{PROG} join: --coordinator is required (or set VOLUNTEER_COORDINATOR)")
    if not settings.run:
        raise UsageError(f"{PROG} join: --run is required (or set VOLUNTEER_RUN)")
    if args.duration is not None and args.duration <= 0:
        raise UsageError(f"{PROG} join: --duration must be positive")
    if args.samples is not None and args.samples <= 0:
        raise UsageError(f"{PROG} join: --samples must be positive")
    out: Any = (
        JsonLines()
        if args.json
        else LiveDisplay(f"volunteer-app · run {settings.run} · {settings.coordinator}")
    )
    follower = JoinFollower(settings=settings, args=args, out=out)
    if isinstance(out, LiveDisplay):
        with out:
            code = asyncio.run(follower.main())
    else:
        code = asyncio.run(follower.main())
    follower.print_summary()
    return code


class JoinFollower:
    """Joins through an agent (in this process with --foreground) and follows the contribution."""

    def __init__(self, *, settings: AgentSettings, args: argparse.Namespace, out: Any):
        self.settings = settings
        self.args = args
        self.out = out
        self.last: Any = None
        self.detached = False
        self.failed: str | None = None

    def _join_command(self) -> Any:
        from volunteer_app.control import JoinCommand

        s, a = self.settings, self.args
        assert s.coordinator is not None and s.run is not None
        return JoinCommand(
            coordinator=s.coordinator, run=s.run, name=s.name, invite_code=s.invite_code,
            duration=a.duration, samples=a.samples, evaluate_on_leave=a.evaluate,
        )  # fmt: skip

    def _limits(self) -> dict[str, Any]:
        a = self.args
        limits = {"max_threads": a.max_threads, "max_memory_gb": a.max_memory, "device": a.device}
        return {k: v for k, v in limits.items() if v is not None}

    async def main(self) -> int:
        import signal

        from volunteer_app.control_client import AgentConnection, ControlError

        interrupted = asyncio.Event()
        self._interrupts = 0
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            self._interrupts += 1
            if self._interrupts > 1:
                raise SystemExit(130)
            interrupted.set()

        if self.args.foreground:
            return await self._foreground(interrupted, interrupt)
        address = ensure_agent(self.settings, self.args, say=self.out.message)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt)
        try:
            async with AgentConnection(address) as connection:
                return await self._join_and_follow(connection, interrupted, foreground=False)
        except ControlError as exc:
            raise UserError(exc.detail) from exc

    async def _foreground(self, interrupted: asyncio.Event, interrupt: Any) -> int:
        import signal

        from volunteer_app.agent import serve_agent
        from volunteer_app.agent.service import AgentService

        code = 0

        async def after_start(service: AgentService) -> None:
            nonlocal code
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, interrupt)
            service.remember_run = False
            try:
                code = await self._join_and_follow(LocalConnection(service), interrupted, foreground=True)
            finally:
                service.request_stop()

        await serve_agent(self.settings, after_start=after_start, handle_signals=False)
        return code

    async def _join_and_follow(self, connection: Any, interrupted: asyncio.Event, *, foreground: bool) -> int:
        from volunteer_app.control import LogEntry, SettingsCommand
        from volunteer_app.control_client import ControlError
        from volunteer_app.display import LiveDisplay

        out = self.out
        try:
            if self._limits():
                await connection.call(SettingsCommand(values=self._limits()))
            command = self._join_command()
            result = await connection.call(command, timeout=600)
        except ControlError as exc:
            raise UserError(exc.detail) from exc
        while isinstance(
            item := await connection.next_event(0.2), (set, LogEntry)
        ):  # what joining said first
            if isinstance(item, LogEntry):
                out.message(item.message)
        if not result.message.startswith("joined run"):
            out.message(result.message)
        run, stopping = command.run, False
        while True:
            state = connection.state
            contribution = state.contribution if state is not None else None
            if contribution is not None and contribution.run == run:
                self.last = contribution
                if isinstance(out, LiveDisplay):
                    where = f"config {self.settings.config_dir} · log {self.settings.logs_dir}"
                    hint = "Ctrl-C leaves" if foreground else "Ctrl-C detaches (the agent keeps training)"
                    out.update([contribution], f"{where} · {hint}")
                else:
                    out.status([contribution], every=self.settings.status_interval)
                    if out.closed and not stopping:
                        interrupted.set()
                if contribution.state in ("stopped", "failed"):
                    if contribution.state == "failed":
                        self.failed = contribution.last_error or "the contribution failed"
                    return 1 if self.failed else 0
            if connection.closed.is_set():
                if stopping:
                    return 0
                raise UserError(
                    "the agent went away (see its log: " + str(self.settings.agent_log_path) + ")"
                )
            if interrupted.is_set() and not stopping:
                interrupted.clear()
                if foreground or getattr(out, "closed", False):
                    stopping = True
                    out.message(
                        "stopping: finishing the current step and leaving the swarm (Ctrl-C again to force)"
                    )
                    leave = asyncio.create_task(connection.call(_leave_command(), timeout=600))
                    leave.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
                else:
                    self.detached = True
                    out.message(
                        "detached: the agent keeps contributing in the background (`volunteer-app status`, "
                        "`volunteer-app leave`, `volunteer-app stop`)"
                    )
                    return 0
            item = await connection.next_event(0.5)
            if isinstance(item, LogEntry):
                out.message(item.message)

    def print_summary(self) -> None:
        from volunteer_app.display import JsonLines, status_dict

        s = self.last
        if isinstance(self.out, JsonLines):
            self.out.emit("summary", **(status_dict(s) if s is not None else {}), detached=self.detached)
        elif s is not None and not self.detached:
            print(
                one_line(
                    f"{'failed' if self.failed else 'stopped'} ({self.failed or s.stop_reason or 'done'}): "
                    f"trained {s.samples_total} samples, credited {s.samples_credited} in {s.leases_completed} "
                    "leases"
                )
            )
        if self.failed:
            raise UserError(self.failed)


def _leave_command() -> Any:
    from volunteer_app.control import LeaveCommand

    return LeaveCommand()


class LocalConnection:
    """The :class:`~volunteer_app.control_client.AgentConnection` interface over an in-process service."""

    def __init__(self, service: Any):
        from volunteer_app.control_client import ControlError

        self.service = service
        self._error = ControlError
        self.subscriber = service.hub.subscribe()
        self.closed = service.stop_event
        self._pending: list[Any] = []

    @property
    def state(self) -> Any:
        return self.service.state

    async def call(self, command: Any, *, timeout: float = 300.0) -> Any:
        from volunteer_app.agent.service import CommandError

        try:
            return await asyncio.wait_for(self.service.handle(command), timeout=timeout)
        except CommandError as exc:
            raise self._error(exc.code, exc.detail) from exc

    async def next_event(self, timeout: float | None = None) -> Any:
        if not self._pending:
            try:
                await asyncio.wait_for(self.subscriber.ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
            changes, log = self.subscriber.take()
            self._pending.extend([set(changes)] if changes else [])
            self._pending.extend(log)
        return self._pending.pop(0) if self._pending else None


# ----------------------------------------------------------------------------------------- the app
def _cmd_app(args: argparse.Namespace) -> int:
    """No command: the app (Textual), attached to the running agent or to one started in the background."""
    web_driver = bool(os.environ.get("TEXTUAL_DRIVER"))  # a browser tab of `volunteer-app web`
    if not web_driver and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            f"{PROG} without a command opens the terminal app and needs a terminal; see `{PROG} --help` for the "
            "shell commands (status, join, ...)"
        )
    settings = _agent_settings(args)
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


def _cmd_web(args: argparse.Namespace) -> int:
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
    settings = _agent_settings(args)
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


# ----------------------------------------------------------------------------------------- demo
def demo_options(args: argparse.Namespace) -> DemoOptions:
    """The demo's options from ``volunteer-app demo``'s arguments: what was given, DemoOptions' defaults
    for the rest (one source of defaults: the command ran another demo than the one documented when
    argparse had its own)."""
    from volunteer_app.demo import DemoOptions

    options = DemoOptions(
        json=args.json, keep=args.keep, threads=args.threads, headless=args.headless, verbose=args.verbose
    )
    for name in ("peers", "duration", "preset", "target_batch_size"):
        if getattr(args, name) is not None:
            setattr(options, name, getattr(args, name))
    return options


def _cmd_demo(args: argparse.Namespace) -> int:
    from volunteer_app.demo import run_demo

    run_demo(demo_options(args))
    return 0


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        return _cmd_app(args)
    handlers = {
        "profile": _cmd_profile,
        "agent": _cmd_agent,
        "join": _cmd_join,
        "status": _cmd_status,
        "pause": _command("pause"),
        "resume": _command("resume"),
        "finish": _command("finish"),
        "leave": _command("leave"),
        "stop": _cmd_stop,
        "snooze": _command("snooze", _snooze_params),  # type: ignore[arg-type]
        "settings": _cmd_settings,
        "demo": _cmd_demo,
        "web": _cmd_web,
    }
    return int(handlers[args.command](args))


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from volunteer_app.agent.contribution import AgentError
    from volunteer_app.agent.service import AgentAlreadyRunning
    from volunteer_app.client import CoordinatorRefused, CredentialStoreError
    from volunteer_app.control import validation_problems
    from volunteer_app.demo import DemoError
    from volunteer_app.identity import IdentityError

    try:
        return run_main(
            _main,
            argv,
            prog=PROG,
            user_errors=(
                AgentError, AgentAlreadyRunning, DemoError, CoordinatorRefused, CredentialStoreError,
                IdentityError, ValueError,
            ),
        )  # fmt: skip
    except ValidationError as exc:
        print(f"error: invalid setting: {validation_problems(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
