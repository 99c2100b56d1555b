"""The speed test: samples per second of the run's training step on this machine, measured once and cached.

It runs ``python -m workers.bench`` (only workers import torch) with the device, threads and micro-batch
the assignment policy (:mod:`volunteer_app.assignment`) would give this machine, so the figure sent at
join is the speed the assignment trains at. Results are cached in ``benchmarks.json`` in the config dir,
keyed by task, config, device, threads, micro-batch, CPU, torch version, GPUs and memory limit; a re-measure on the
volunteer's request (the TUI's "this machine" screen) replaces the cached figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from volunteer_app.agent.worker import isolated_python
from volunteer_app.assignment import AssignmentError, compute_plan
from volunteer_app.protocol import HardwareProfile, RunOut, TaskBenchmark
from volunteer_app.tokens import write_private_file
from volunteer_app.worker_protocol import EXIT_RUN_REFUSED


class SpeedTestCache:
    """``benchmarks.json``: one measured :class:`TaskBenchmark` per machine/task configuration."""

    def __init__(self, path: Path):
        self.path = path

    def _load(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
            if isinstance(data, dict):
                return data
        return {}

    def get(self, key: str) -> TaskBenchmark | None:
        entry = self._load().get(key)
        if entry is None:
            return None
        try:
            return TaskBenchmark.model_validate(entry)
        except ValidationError:
            return None

    def put(self, key: str, result: TaskBenchmark) -> None:
        data = self._load()
        data[key] = result.model_dump(mode="json")
        with contextlib.suppress(OSError):
            write_private_file(self.path, json.dumps(data, indent=2).encode())


class RunRefused(Exception):
    """This machine will not train the run (its task is not installed, its config or files are refused,
    or its model does not fit the memory limit); the message says why."""


def speed_test_key(
    *, run: RunOut, profile: HardwareProfile, device: str, threads: int, micro: int, memory_limit: int | None
) -> str:
    source = json.dumps(
        [run.task, run.task_config, device, threads, micro, profile.cpu_model, profile.torch,
         [g.name for g in profile.gpus], memory_limit],
        sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(source.encode()).hexdigest()[:24]


async def measure_speed(
    *,
    run: RunOut,
    profile: HardwareProfile,
    cache: SpeedTestCache,
    seconds: float,
    max_threads: int | None,
    device: str,
    on_message: Callable[[str], None],
    work_dir: Path,
    memory_limit: int | None = None,
    files: dict[str, str] | None = None,
    cache_dir: Path | None = None,
    refresh: bool = False,
) -> TaskBenchmark | None:
    """Check the run on this machine, and its training speed: from the cache, else measured in a subprocess.

    The subprocess (``python -m workers.bench``, started apart from the volunteer's folders:
    :func:`~volunteer_app.agent.worker.isolated_python`) first checks the run as the worker will (the task
    installed, the files from ``cache_dir`` only, the model within ``memory_limit``); with ``seconds`` 0 it
    only checks. A cached figure was measured after the same checks passed for the same run and limit.

    Returns None (and says why) when the measurement fails; joining then goes on without it.

    :raises RunRefused: when this machine will not train the run.
    """
    try:
        plan = compute_plan(profile=profile, max_threads=max_threads, device=device)
    except AssignmentError as exc:
        on_message(f"{exc}; measuring on the CPU")
        plan = compute_plan(profile=profile, max_threads=max_threads, device="cpu")
    key = speed_test_key(
        run=run, profile=profile, device=plan.device, threads=plan.threads, micro=plan.micro_batch_size,
        memory_limit=memory_limit,
    )  # fmt: skip
    cached = None if refresh or seconds <= 0 else cache.get(key)
    if cached is not None:
        return cached
    if seconds > 0:
        on_message(f"measuring this machine on {run.task} for {seconds:.0f} s...")
    argv, env = isolated_python("workers.bench", work_dir)
    argv += [
        "--task", run.task, "--config", json.dumps(run.task_config),
        "--threads", str(plan.threads), "--device", plan.device, "--micro-batch", str(plan.micro_batch_size),
    ]  # fmt: skip
    argv += ["--seconds", str(seconds)] if seconds > 0 else ["--fit-only"]
    if memory_limit is not None:
        argv += ["--memory-limit-bytes", str(memory_limit)]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    for digest, path in (files or {}).items():
        argv += ["--file", f"{digest}={path}"]
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        env=env, cwd=work_dir,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=seconds + 120)
    except asyncio.TimeoutError:
        process.kill()
        on_message("the speed test took too long; joining without it")
        return None
    except asyncio.CancelledError:
        process.kill()
        raise
    last = (out.decode(errors="replace").strip().splitlines() or [""])[-1]
    if process.returncode == EXIT_RUN_REFUSED:
        try:
            detail = str(json.loads(last)["detail"])
        except (ValueError, KeyError, TypeError):
            detail = "the run was refused"
        raise RunRefused(detail)
    if process.returncode != 0:
        on_message(
            f"the speed test failed ({err.decode(errors='replace').strip()[-200:]}); joining without it"
        )
        return None
    if seconds <= 0:
        return None
    try:
        result = TaskBenchmark.model_validate_json(last)
    except ValidationError:
        on_message("the speed test printed nothing usable; joining without it")
        return None
    cache.put(key, result)
    on_message(f"this machine trains {run.task} at {result.samples_per_second:.0f} samples/s")
    return result
