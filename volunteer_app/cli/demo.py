"""``volunteer-app demo``: a coordinator on loopback and N local peers training ``shapes-dalle`` together,
then a summary and the model's drawings (``volunteer_app.demo`` runs it; this is its command line)."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from volunteer_app.demo import DemoOptions


def add_parsers(commands: Any) -> None:
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
        "--samples",
        type=int,
        default=None,
        metavar="N",
        help="stop once the peers have trained N samples together (or at --duration, whichever comes first; "
        "without --duration there is no time limit), with the learning rate decayed over exactly them: the "
        "same model on a slow machine, only later",
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
    demo.set_defaults(handler=run_demo)


def demo_options(args: argparse.Namespace) -> DemoOptions:
    """The demo's options from ``volunteer-app demo``'s arguments: what was given, DemoOptions' defaults
    for the rest (one source of defaults: the command ran another demo than the one documented when
    argparse had its own)."""
    from volunteer_app.demo import DemoOptions

    options = DemoOptions(
        json=args.json, keep=args.keep, threads=args.threads, headless=args.headless, verbose=args.verbose
    )
    for name in ("peers", "duration", "samples", "preset", "target_batch_size"):
        if getattr(args, name) is not None:
            setattr(options, name, getattr(args, name))
    if args.samples is not None and args.duration is None:
        options.duration = math.inf
    return options


def run_demo(args: argparse.Namespace) -> int:
    """``demo``: a whole local swarm, a coordinator and N peers on loopback, then a summary."""
    from volunteer_app.demo import run_demo as run

    run(demo_options(args))
    return 0
