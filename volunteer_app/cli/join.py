"""``volunteer-app join``: contribute to a run and follow it (headless, for servers and scripts).

The agent does the work: ``join`` starts it in the background if none runs, asks it to join, and follows
the contribution (a live panel, or JSON lines) until Ctrl-C detaches. ``--foreground`` runs the agent in
this very process instead (containers, scripts whose Ctrl-C should leave the run), followed through a
:class:`~volunteer_app.control_client.LocalConnection`, the same interface as a remote agent's.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import TYPE_CHECKING, Any

from volunteer_app.cli.agent import ensure_agent
from volunteer_app.cli.common import PROG, add_config_dir, add_network, agent_settings
from volunteer_app.cliutil import UsageError, UserError
from volunteer_app.control import JoinCommand, LeaveCommand, LogEntry, SettingsCommand
from volunteer_app.control_client import AgentConnection, ControlError, LocalConnection
from volunteer_app.safetext import one_line

if TYPE_CHECKING:
    from volunteer_app.settings import AgentSettings


def add_parsers(commands: Any) -> None:
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
    add_network(join)
    add_config_dir(join)
    join.add_argument(
        "--json", action="store_true", help="print JSON lines (messages, status every 5 s, summary)"
    )

    join.set_defaults(handler=run_join)


def run_join(args: argparse.Namespace) -> int:
    """``join``: join through the agent (started if need be) and follow the contribution until it ends or
    Ctrl-C detaches (with ``--foreground``: leaves)."""
    from volunteer_app.display import JsonLines, LiveDisplay

    settings = agent_settings(args)
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
                    leave = asyncio.create_task(connection.call(LeaveCommand(), timeout=600))
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
