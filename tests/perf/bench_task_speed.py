"""Training speed of the built-in tasks' presets: samples per second on one CPU thread, and model sizes.

Run it from the repository root (pytest does not collect it)::

    python tests/perf/bench_task_speed.py                 # every preset of shapes-dalle and tiny-lm
    python tests/perf/bench_task_speed.py --task shapes-dalle --preset tiny --seconds 20

One "step" is what a volunteer's worker does per micro-batch: the task's loss (forward), backward and
an AdamW step. The figure quoted in ``shapes-dalle``'s ``tiny`` preset comes from this script.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from workers.tasks import load_task


def bench_preset(task_name: str, preset: str, *, batch_size: int, seconds: float) -> dict[str, float]:
    """Time training steps of ``task_name``'s ``preset`` for about ``seconds``.

    :returns: ``samples_per_s``, ``params`` and, for ``shapes-dalle``, ``images_per_s`` sampled with the
      KV cache (greedy, batch ``batch_size``).
    """
    spec = load_task(task_name)
    config = spec.make_config({"preset": preset})
    runtime: Any = spec.build_runtime(config)  # example_batch and sample are beyond the protocol
    model = runtime.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    batch = runtime.example_batch(batch_size)

    def step() -> None:
        loss = runtime.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or steps < 3:
        step()
        steps += 1
    elapsed = time.perf_counter() - start
    result = {"samples_per_s": steps * batch_size / elapsed, "params": float(model.num_parameters())}
    if hasattr(runtime, "heldout") and hasattr(runtime, "sample"):
        prompts = runtime.heldout()[1][:batch_size]
        start = time.perf_counter()
        runtime.sample(model, prompts, temperature=0.0)
        result["images_per_s"] = len(prompts) / (time.perf_counter() - start)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", action="append", help="task name (repeatable; default: both built-ins)")
    parser.add_argument(
        "--preset", action="append", help="preset name (repeatable; default: all of the task's)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per micro-batch (default 32)")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per preset (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), micro-batch {args.batch_size}")
    for task_name in args.task or ["shapes-dalle", "tiny-lm"]:
        presets = args.preset or sorted(load_task(task_name).presets)
        for preset in presets:
            result = bench_preset(task_name, preset, batch_size=args.batch_size, seconds=args.seconds)
            line = f"{task_name:>12} {preset:<6} {result['params'] / 1e6:6.2f}M params  {result['samples_per_s']:7.1f} samples/s"
            if "images_per_s" in result:
                line += f"  {result['images_per_s']:6.1f} images/s sampled"
            print(line, flush=True)


if __name__ == "__main__":
    main()
