"""Task micro-benchmark: ``python -m workers.bench --task NAME [--config JSON] [--seconds S] [--json]``.

Measures samples per second of the task's full training step (forward, backward, optimizer step) on
this machine with the given threads, device and micro-batch, the way the worker trains. The agent runs
it while profiling; the coordinator sizes leases and caps credits from it. Prints a TaskBenchmark.

Before it builds anything it checks the run the way the worker does (``workers.trainer``): the task must
be installed, the files the config names come only from the agent's cache (``--cache-dir``, ``--file
SHA256=PATH``), and the model must fit ``--memory-limit-bytes`` (also set on the process by the operating
system). A refused run prints ``{"error": "run_refused", "detail": ...}`` and exits with status 5;
``--fit-only`` stops after those checks (``{"parameters": N}``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from volunteer_app.worker_protocol import EXIT_RUN_REFUSED


def measure(
    *,
    task: str,
    config: dict[str, Any],
    threads: int,
    device: str,
    micro_batch: int,
    seconds: float,
    accumulation: int = 1,
    warmup: int = 2,
    memory_limit_bytes: int | None = None,
    files: dict[str, str] | None = None,
    cache_dir: str | None = None,
    fit_only: bool = False,
) -> dict[str, Any]:
    """Run the training step for ``seconds`` (after ``warmup`` steps) and return a TaskBenchmark dict
    (with ``fit_only``: ``{"parameters": N}`` once the run's checks passed).

    :raises UnknownTaskError, TaskConfigError, ModelTooBig: for a run this machine refuses.
    """
    import torch

    from workers import runfiles
    from workers.fitting import cap_process_memory, check_model_fits
    from workers.tasks import load_task

    cap_process_memory(memory_limit_bytes, device=device)
    torch.set_num_threads(threads)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda asked for but torch sees no CUDA GPU")
    spec = load_task(task)
    task_config = runfiles.task_config(spec, config, files=files or {}, cache_dir=cache_dir)
    runtime = spec.build_runtime(task_config)
    parameters = check_model_fits(runtime, limit_bytes=memory_limit_bytes, device=device)
    if fit_only:
        return {"parameters": parameters}
    model = runtime.build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=getattr(task_config, "lr", 1e-3))
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else None
    batches = runtime.shard_batches(0, batch_size=micro_batch, seed=0, device=device)
    iterator = iter(batches)

    count = 0

    def step() -> int:
        nonlocal iterator, count
        batch = next(iterator, None)
        if batch is None:
            iterator = iter(runtime.shard_batches(1, batch_size=micro_batch, seed=1, device=device))
            batch = next(iterator)
        if amp is not None:
            with amp:
                loss = runtime.loss(model, batch)
        else:
            loss = runtime.loss(model, batch)
        (loss / accumulation).backward()
        count += 1
        if count % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return runtime.batch_size_of(batch)

    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    samples = 0
    started = time.perf_counter()
    while True:
        samples += step()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            break
    if device == "cuda":
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
    return {
        "task": task,
        "preset": getattr(task_config, "preset", None),
        "device": device,
        "threads": threads,
        "micro_batch_size": micro_batch,
        "samples_per_second": round(samples / elapsed, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.bench", description=__doc__)
    parser.add_argument("--task", required=True)
    parser.add_argument("--config", default="{}", help="task config overrides as a JSON object")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--memory-limit-bytes",
        type=int,
        default=None,
        help="refuse a model that needs more (and cap the process)",
    )
    parser.add_argument("--cache-dir", default=None, help="the agent's file cache (the only files read)")
    parser.add_argument(
        "--file", action="append", default=[], metavar="SHA256=PATH", help="a file of the run, in the cache"
    )
    parser.add_argument("--fit-only", action="store_true", help="only check the run; measure nothing")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as exc:
        print(f"error: --config is not valid JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(config, dict):
        print("error: --config must be a JSON object", file=sys.stderr)
        return 2
    files = dict(item.partition("=")[::2] for item in args.file)
    from workers.fitting import ModelTooBig
    from workers.tasks import TaskConfigError, UnknownTaskError

    try:
        result = measure(
            task=args.task,
            config=config,
            threads=args.threads,
            device=args.device,
            micro_batch=args.micro_batch,
            seconds=args.seconds,
            accumulation=args.accumulation,
            memory_limit_bytes=args.memory_limit_bytes,
            files=files,
            cache_dir=args.cache_dir,
            fit_only=args.fit_only,
        )
    except (UnknownTaskError, TaskConfigError, ModelTooBig) as exc:
        print(json.dumps({"error": "run_refused", "detail": str(exc)}))
        return EXIT_RUN_REFUSED
    except Exception as exc:
        print(f"error: benchmark failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
