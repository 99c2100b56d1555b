"""``volunteer-app``: contribute your computer to a collaborative training run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from volunteer_app import __version__
from volunteer_app.cliutil import ArgumentParser, UsageError, UserError, run_main
from volunteer_app.profile import describe, profile_machine

if TYPE_CHECKING:
    from volunteer_app.settings import AgentSettings

PROG = "volunteer-app"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Lend your computer to a research group's collaborative training run (peer to peer, with hivemind).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    profile = commands.add_parser("profile", help="show this machine's hardware profile (CPU, memory, GPUs)")
    profile.add_argument("--json", action="store_true", help="print the profile as JSON")
    profile.add_argument(
        "--task", default=None, help="also measure training speed on this task (e.g. shapes-dalle)"
    )
    profile.add_argument(
        "--seconds", type=float, default=4.0, help="length of the speed measurement (default 4)"
    )

    join = commands.add_parser(
        "join",
        help="contribute to a run, headless (for servers and scripts)",
        description="Register (once), profile this machine, join the run and train until stopped (Ctrl-C) or "
        "--duration has passed. Settings can also come from VOLUNTEER_* environment variables.",
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
        help="stop after this long (default: never)",
    )
    join.add_argument(
        "--samples", type=int, default=None, metavar="N", help="stop after training this many samples"
    )
    join.add_argument(
        "--evaluate", action="store_true", help="evaluate the shared model on held-out data before leaving"
    )
    join.add_argument(
        "--listen-host", default=None, help="address the swarm peer listens on (default 0.0.0.0)"
    )
    join.add_argument(
        "--announce-host", default=None, help="public address to announce when ports are forwarded"
    )
    join.add_argument(
        "--no-incoming", action="store_true", help="this machine cannot accept connections (client mode)"
    )
    join.add_argument(
        "--config-dir", type=Path, default=None, help="where the credential, keys and logs live"
    )
    join.add_argument(
        "--json", action="store_true", help="print JSON lines (messages, status every 5 s, summary)"
    )

    demo = commands.add_parser(
        "demo",
        help="run a whole local swarm: a coordinator and N peers training shapes-dalle together",
        description="Starts a coordinator on loopback with a temporary data dir, creates a shapes-dalle run and "
        "runs N peers that train it together, then prints a summary.",
    )
    demo.add_argument("--peers", type=int, default=2, help="local peers (default 2)")
    demo.add_argument(
        "--duration", type=float, default=90.0, metavar="SECONDS", help="training time (default 90)"
    )
    demo.add_argument(
        "--headless", action="store_true", help="no full-screen UI (the demo is headless until the TUI lands)"
    )
    demo.add_argument("--json", action="store_true", help="JSON lines, ending with a summary line")
    demo.add_argument("--preset", default="tiny", choices=["tiny", "base"], help="model size (default tiny)")
    demo.add_argument(
        "--target-batch-size",
        type=int,
        default=512,
        help="samples between parameter averaging rounds (default 512)",
    )
    demo.add_argument("--threads", type=int, default=None, help="threads per peer (default: cores / peers)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    return parser


def _cmd_profile(args: argparse.Namespace) -> int:
    profile = profile_machine()
    if args.task:
        import asyncio

        from volunteer_app.protocol import OptimizerSettings, RunOut, RunStats
        from volunteer_app.settings import AgentSettings
        from volunteer_app.supervisor import benchmark_task

        run = RunOut(
            name="profile",
            task=args.task,
            description="",
            state="active",
            visibility="open",
            created_at=0,
            data_epochs=1,
            task_config={},
            optimizer=OptimizerSettings(),
            stats=RunStats(),
        )
        settings = AgentSettings(benchmark_seconds=args.seconds)
        notes = sys.stderr
        benchmark = asyncio.run(
            benchmark_task(
                run=run, profile=profile, settings=settings, on_message=lambda text: print(text, file=notes)
            )
        )
        if benchmark is None:
            raise UserError(f"could not measure the speed of task {args.task!r}")
        profile = profile.model_copy(update={"benchmark": benchmark})
    if args.json:
        print(json.dumps(profile.model_dump(mode="json"), indent=2))
    else:
        print("\n".join(describe(profile)))
    return 0


def _agent_settings(args: argparse.Namespace) -> AgentSettings:
    from volunteer_app.settings import AgentSettings

    overrides = {
        "config_dir": args.config_dir,
        "coordinator": args.coordinator,
        "run": args.run,
        "name": args.name,
        "invite_code": args.invite_code,
        "max_threads": args.max_threads,
        "max_memory_gb": args.max_memory,
        "device": args.device,
        "listen_host": args.listen_host,
        "announce_host": args.announce_host,
        "accepts_connections": False if args.no_incoming else None,
    }
    return AgentSettings(**{k: v for k, v in overrides.items() if v is not None})


def _cmd_join(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from volunteer_app.display import JsonLines, LiveDisplay
    from volunteer_app.supervisor import Agent

    settings = _agent_settings(args)
    if not settings.coordinator:
        raise UsageError(f"{PROG} join: --coordinator is required (or set VOLUNTEER_COORDINATOR)")
    if not settings.run:
        raise UsageError(f"{PROG} join: --run is required (or set VOLUNTEER_RUN)")
    if args.duration is not None and args.duration <= 0:
        raise UsageError(f"{PROG} join: --duration must be positive")
    if args.samples is not None and args.samples <= 0:
        raise UsageError(f"{PROG} join: --samples must be positive")
    out = (
        JsonLines()
        if args.json
        else LiveDisplay(f"volunteer-app · run {settings.run} · {settings.coordinator}")
    )
    agent = Agent(
        settings=settings,
        coordinator=settings.coordinator,
        run=settings.run,
        duration=args.duration,
        max_samples=args.samples,
        evaluate_on_stop=args.evaluate,
        on_message=lambda text: out.message(text),
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        interrupts = 0

        def interrupt() -> None:
            nonlocal interrupts
            interrupts += 1
            if interrupts == 1:
                out.message(
                    "stopping: finishing the current step and leaving the swarm (Ctrl-C again to force)"
                )
                agent.request_stop("stopped with Ctrl-C")
            else:
                raise SystemExit(130)

        loop.add_signal_handler(signal.SIGINT, interrupt)
        loop.add_signal_handler(signal.SIGTERM, interrupt)
        task = asyncio.create_task(agent.run())
        while not task.done():
            if isinstance(out, LiveDisplay):
                out.update(
                    [agent.status],
                    f"config {settings.config_dir} · worker log {agent.worker_log()} · Ctrl-C stops",
                )
            else:
                out.status([agent.status], every=settings.status_interval)
                if out.closed:
                    agent.request_stop("the reader of --json output went away")
            await asyncio.wait({task}, timeout=0.5)
        task.result()

    try:
        if isinstance(out, LiveDisplay):
            with out:
                asyncio.run(main())
        else:
            asyncio.run(main())
    finally:
        summary = agent.status.as_dict()
        summary.pop("profile", None)
        if isinstance(out, JsonLines):
            out.emit("summary", **summary)
    if not isinstance(out, JsonLines):
        s = agent.status
        print(
            f"stopped ({s.stop_reason or 'done'}): trained {s.samples_total} samples, "
            f"credited {s.samples_credited} in {s.leases_completed} leases"
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from volunteer_app.demo import DemoOptions, run_demo

    run_demo(
        DemoOptions(
            peers=args.peers,
            duration=args.duration,
            json=args.json,
            keep=args.keep,
            preset=args.preset,
            target_batch_size=args.target_batch_size,
            threads=args.threads,
        )
    )
    return 0


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handlers = {"profile": _cmd_profile, "join": _cmd_join, "demo": _cmd_demo}
    return handlers[args.command](args)


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from volunteer_app.client import CoordinatorRefused, CredentialStoreError
    from volunteer_app.demo import DemoError
    from volunteer_app.identity import IdentityError
    from volunteer_app.supervisor import AgentError

    try:
        return run_main(
            _main,
            argv,
            prog=PROG,
            user_errors=(
                AgentError,
                DemoError,
                CoordinatorRefused,
                CredentialStoreError,
                IdentityError,
                ValueError,
            ),
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        print(f"error: invalid setting: {problems}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
