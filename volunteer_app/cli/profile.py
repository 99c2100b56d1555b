"""``volunteer-app profile``: what this machine is (CPU, memory, GPUs) and, for a task, how fast it trains."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from volunteer_app.cliutil import UserError
from volunteer_app.profile import describe, profile_machine
from volunteer_app.protocol import OptimizerSettings, RunOut, RunStats
from volunteer_app.settings import AgentSettings


def add_parsers(commands: Any) -> None:
    profile = commands.add_parser("profile", help="show this machine's hardware profile (CPU, memory, GPUs)")
    profile.add_argument("--json", action="store_true", help="print the profile as JSON")
    profile.add_argument(
        "--task", default=None, help="also measure training speed on this task (e.g. shapes-dalle)"
    )
    profile.add_argument(
        "--seconds", type=float, default=4.0, help="length of the speed measurement (default 4)"
    )
    profile.set_defaults(handler=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    """``profile``: this machine's hardware, and with ``--task`` its training speed on that task."""
    profile = profile_machine()
    if args.task:
        from volunteer_app.agent.speedtest import RunRefused, SpeedTestCache, measure_speed

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
