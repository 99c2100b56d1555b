"""Benchmark: the training loss of a three-peer swarm with one poisoning volunteer, beside the same swarm
without poison.

    python tests/perf/bench_poisoning.py [--seconds 60] [--modes gradients,local] [--swarms honest,poisoned]

For each update mode (``gradients``: mallory reverses and amplifies her gradients x1000; ``local``: she
contributes her parameters x -10; in both she answers garbage for the parts she reduces) it runs the real
product once per swarm, one after the other: ``serve`` and three ``volunteer-app join`` peers on
``shapes-dalle tiny``: ``honest`` (no poison), ``poisoned`` (mallory poisoning,
``tests/security/poisoner``), and on request ``undefended`` (mallory poisoning honest peers that average
as plain hivemind does, ``tests/security/undefended``: the "before" figures). It prints the honest
peers' training loss every 10 s from the moment all three have averaged together, and how many rounds their
workers left contributions out or refused answers. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.security.poisoning import HONEST, run_swarm  # noqa: E402


def at(curve: list[tuple[float, float]], seconds: float) -> float | None:
    """The last loss sampled at or before ``seconds``."""
    losses = [loss for t, loss in curve if t <= seconds]
    return losses[-1] if losses else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="training time per swarm (default 60)")
    parser.add_argument("--modes", default="gradients,local", help="update modes to attack (default both)")
    parser.add_argument(
        "--swarms", default="honest,poisoned", help="honest, poisoned, undefended (default honest,poisoned)"
    )
    args = parser.parse_args()
    poison_of = {"gradients": "gradients", "local": "parameters"}
    results = {}
    for mode in args.modes.split(","):
        for label in args.swarms.split(","):
            poison = None if label == "honest" else poison_of[mode]
            print(f"{mode}: {label} swarm, {args.seconds:.0f} s...", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(prefix="bench-poison-") as root:
                results[(mode, label)] = run_swarm(
                    Path(root),
                    poison=poison,
                    mode=mode,
                    seconds=args.seconds,
                    undefended=label == "undefended",
                )
    marks = [t for t in range(0, int(args.seconds) + 1, 10)]
    print(f"honest peers' training loss (mean of {', '.join(HONEST)}) after all three averaged together:")
    print(f"{'mode':<10} {'swarm':<10} " + " ".join(f"{t:>6}s" for t in marks) + "   left out  refused")
    for (mode, label), result in results.items():
        row = []
        for t in marks:
            values = [at(result["curves"][name], t) for name in HONEST]
            known = [v for v in values if v is not None]
            row.append(f"{sum(known) / len(known):7.3g}" if known else "      -")
        left_out = sum(result["left_out"].values())
        refused = sum(result["refusals"].values())
        print(f"{mode:<10} {label:<10} " + " ".join(row) + f"   {left_out:>8}  {refused:>7}")
    print(json.dumps({f"{m}/{label}": r["curves"] for (m, label), r in results.items()}))


if __name__ == "__main__":
    main()
