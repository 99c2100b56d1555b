"""Quality at an equal sample budget: the demo's 2-peer swarm against one process trained alone.

    python tests/perf/bench_quality.py                          # 15 minutes of the swarm, then one process
    python tests/perf/bench_quality.py --duration 270           # the 5-minute demo's budget
    python tests/perf/bench_quality.py --reference one.jsonl    # one process's curve from an earlier run

Runs the demo's swarm as ``bench_demo.py`` does (a coordinator and ``--peers`` real hivemind peers on
loopback, the coordinator's default run settings, 15 minutes by default: the speed-to-quality target's
limit) and evaluates every checkpoint its coordinator saved. Then it trains one process alone
(``bench_learning.py single``: an AdamW step per 32 samples) on the same task config and learning-rate
schedule, read from the swarm's last checkpoint, up to that checkpoint's sample count, evaluated every
``--eval-every`` samples and at that count, on the same held-out captions (greedy decoding). Prints both
curves side by side, the gap at the equal budget, and whether it is within ``--within`` points of prompt
accuracy (the target: 2).

One process alone is deterministic (seeded weights, data order and held-out set), so its curve for a config
can be computed once (``bench_learning.py single --samples N --eval-every E --config ... --out FILE``) and
given with ``--reference FILE`` for further swarm runs. The swarm's last checkpoint is then compared with
the reference's evaluation nearest to it, or, where the reference ends first, the reference's last
evaluation with the swarm's checkpoint nearest to it (both sample counts are printed); a reference whose
task config differs from the swarm's is refused. The one process trains after the swarm has
stopped, so neither takes CPU from the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.perf.bench_demo import add_demo_arguments, demo_options, report, run_and_evaluate  # noqa: E402
from tests.perf.bench_learning import _parse_config  # noqa: E402

FIFTEEN_MINUTES = 840.0
"""Training seconds of the default run: with the demo's start and summary, 15 minutes of wall time."""


def _read_reference(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The start label and the evaluations of a ``bench_learning.py`` JSON-lines file (its last run)."""
    label: dict[str, Any] | None = None
    points: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"cannot read the reference {path}: {exc}") from exc
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "start" in record:
            label, points = record["start"], []
        elif "samples" in record and "prompt_accuracy" in record:
            points.append(record)
    if label is None or not points:
        raise SystemExit(f"{path} holds no bench_learning.py run (a start line and its evaluations)")
    return label, points


def _config_differences(
    task: str, ours: dict[str, Any], theirs: dict[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """Fields where two task configs (each completed from its preset) differ."""
    from workers.tasks import load_task

    spec = load_task(task)
    a = dataclasses.asdict(spec.make_config(ours))
    b = dataclasses.asdict(spec.make_config(theirs))
    return {key: (a.get(key), b.get(key)) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)}


def _check_reference(task: str, task_config: dict[str, Any], reference: tuple[dict[str, Any], Any]) -> None:
    """Refuse a reference that is not one process alone on ``task_config``."""
    label = reference[0]
    if label.get("mode") != "single":
        raise SystemExit(f"the reference is a {label.get('mode')!r} run, not one process alone (single)")
    from workers.tasks import TaskConfigError

    try:
        differences = _config_differences(task, task_config, dict(label.get("config", {})))
    except TaskConfigError as exc:
        raise SystemExit(f"the task configs cannot be compared: {exc}") from exc
    if differences:
        shown = ", ".join(
            f"{key}: the swarm's {a!r}, the reference's {b!r}" for key, (a, b) in differences.items()
        )
        raise SystemExit(f"the reference was trained on another task config ({shown})")


def _train_one_process(
    task: str, task_config: dict[str, Any], samples: int, eval_every: int, threads: int
) -> list[dict[str, Any]]:
    """Train one process alone to ``samples`` with ``task_config`` (bench_learning.py single); its curve."""
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        out = Path(tmp) / "one.jsonl"
        command = [
            sys.executable, str(REPO / "tests" / "perf" / "bench_learning.py"), "single", "--task", task,
            "--samples", str(samples), "--eval-every", str(eval_every), "--threads", str(threads),
            "--out", str(out), "--config", *(f"{key}={json.dumps(value)}" for key, value in task_config.items()),
        ]  # fmt: skip
        print(f"\none process alone on the swarm's task config, to {samples} samples:", flush=True)
        with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True) as process:
            assert process.stdout is not None
            for line in process.stdout:  # its evaluations, as progress
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "prompt_accuracy" in record:
                    print(
                        f"  {record['samples']:>8} samples  accuracy {record['prompt_accuracy']:.3f}  "
                        f"loss {record['loss']:.3f}  ({record['seconds']:.0f} s)",
                        flush=True,
                    )
        if process.returncode != 0:
            raise SystemExit("the one-process run failed (its error is above)")
        return _read_reference(out)[1]


def _nearest(points: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """The point whose sample count is nearest ``samples``."""
    return min(points, key=lambda p: abs(int(p["samples"]) - samples))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_demo_arguments(parser, duration_help=f"the swarm's training seconds (default {FIFTEEN_MINUTES:.0f})")
    parser.add_argument("--eval-every", type=int, default=20_000, help="one process's evaluation interval")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one process")
    parser.add_argument(
        "--reference", type=Path, default=None, help="one process's curve (bench_learning.py --out) to reuse"
    )
    parser.add_argument("--within", type=float, default=2.0, help="the target gap, in points of accuracy")
    parser.add_argument("--out", type=Path, default=None, help="also append the summary's JSON line here")
    args = parser.parse_args()
    if args.duration is None:
        args.duration = FIFTEEN_MINUTES
    task = "shapes-dalle"
    reference = None
    if args.reference is not None:  # checked before the swarm runs, and again against its checkpoints
        from volunteer_app.demo import planned_samples

        reference = _read_reference(args.reference)
        options = demo_options(args, Path(tempfile.gettempdir()))
        planned = {
            "preset": options.preset,
            "decay_samples": planned_samples(options),
            **_parse_config(args.config),  # as `runs create --config` reads them, after the demo's decay
            "eval_prompts": args.eval_prompts,
        }
        _check_reference(task, planned, reference)

    swarm = run_and_evaluate(args)
    report(swarm, args)
    curve, task_config = swarm["curve"], dict(swarm["task_config"])
    if not curve:
        raise SystemExit("the swarm saved no checkpoint, so there is nothing to compare")
    task_config["eval_prompts"] = args.eval_prompts
    budget = int(curve[-1]["samples"])

    if reference is not None:
        _check_reference(task, task_config, reference)
        one = reference[1]
    else:
        one = _train_one_process(task, task_config, budget, args.eval_every, args.threads)
    # the equal budget: the swarm's last checkpoint, or where a shorter reference ends
    if int(one[-1]["samples"]) >= budget:
        swarm_final, one_final = curve[-1], _nearest(one, budget)
    else:
        one_final = one[-1]
        swarm_final = _nearest(curve, int(one_final["samples"]))
    if abs(int(swarm_final["samples"]) - int(one_final["samples"])) > args.eval_every // 2:
        raise SystemExit(
            f"the reference's evaluations ({one[0]['samples']}-{one[-1]['samples']} samples) come nowhere near "
            f"the swarm's last checkpoint ({budget}): train it with bench_learning.py single --samples {budget}"
        )

    print(f"\nprompt accuracy on {args.eval_prompts} held-out captions, sample for sample")
    print(f"  {'samples':>8}  {'one process':>11}  {'swarm (its checkpoint nearest)':>30}  gap (points)")
    for point in one:
        if int(point["samples"]) > budget + args.eval_every // 2:
            break
        near = _nearest(curve, int(point["samples"]))
        gap = 100 * (float(point["prompt_accuracy"]) - near["accuracy"])
        print(
            f"  {int(point['samples']):>8}  {float(point['prompt_accuracy']):>11.3f}  "
            f"{near['accuracy']:>12.3f} at {near['samples']:>7} samples  {gap:>+10.1f}"
        )
    final_gap = 100 * (float(one_final["prompt_accuracy"]) - swarm_final["accuracy"])
    within = final_gap <= args.within
    whose = (
        "its last checkpoint"
        if swarm_final is curve[-1]
        else f"where the reference ends; it went on to {budget}"
    )
    print(
        f"\nat the equal budget: the swarm {swarm_final['accuracy']:.3f} at {swarm_final['samples']} samples "
        f"({whose}), one process {float(one_final['prompt_accuracy']):.3f} at {int(one_final['samples'])}: "
        f"{final_gap:+.1f} points, {'within' if within else 'NOT within'} {args.within:g}"
    )
    first = next((p for p in curve if p["accuracy"] >= args.target), None)  # the swarm's: samples and time
    reached = {
        "swarm": None if first is None else first["samples"],
        "one_process": next(
            (int(p["samples"]) for p in one if float(p["prompt_accuracy"]) >= args.target), None
        ),
    }
    swarm_first = (
        "never" if first is None else f"at {first['samples']} samples, {first['at']:.0f} s after the start"
    )
    one_first = "never" if reached["one_process"] is None else f"at {reached['one_process']} samples"
    print(
        f"first at {args.target} or more: the swarm {swarm_first}; one process {one_first} "
        f"(evaluated every {args.eval_every})"
    )
    line = json.dumps(
        {
            "quality": {
                "duration": args.duration,
                "budget": int(swarm_final["samples"]),
                "swarm_samples": budget,
                "swarm": swarm_final["accuracy"],
                "swarm_loss": swarm_final["loss"],
                "swarm_last": curve[-1]["accuracy"],
                "one_process": float(one_final["prompt_accuracy"]),
                "one_process_samples": int(one_final["samples"]),
                "one_process_loss": float(one_final["loss"]),
                "gap_points": round(final_gap, 2),
                "within": within,
                "swarm_reached_at_seconds": swarm["reached"],
                "samples_to_target": reached,
                "demo_final": swarm["summary"].get("prompt_accuracy"),
                "drawings_correct": swarm["summary"].get("drawings_correct"),
            }
        }
    )
    print(line)
    if args.out is not None:
        with args.out.open("a") as handle:
            handle.write(line + "\n")


if __name__ == "__main__":
    main()
