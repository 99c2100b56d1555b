"""Memory fitting: the largest micro-batch up to the assigned one whose training step fits the memory cap.

On CUDA the cap is the GPU memory (an out-of-memory error halves the micro-batch); on the CPU it is the
volunteer's ``--max-memory`` or, without one, 80 % of the free RAM, compared with the whole process's
resident memory after one forward and backward pass. Samples per optimizer step are kept by
accumulating more micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def probe_step(runtime: Any, model: Any, device: Any, micro: int, autocast: Callable[[], Any]) -> float:
    """Memory after one forward+backward at ``micro`` samples: peak allocated bytes on CUDA, the whole
    process's resident memory on the CPU (what a memory cap limits)."""
    import psutil
    import torch

    batch = next(iter(runtime.shard_batches(0, batch_size=micro, seed=0, device=device)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with autocast():
        loss = runtime.loss(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(psutil.Process().memory_info().rss)


def fit_micro_batch(
    *,
    runtime: Any,
    model: Any,
    device: Any,
    micro_batch: int,
    samples_per_step: int,
    memory_cap: int | None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    probe: Callable[[int], float] | None = None,
    available: Callable[[], int] | None = None,
) -> tuple[int, int]:
    """``(micro_batch, accumulation_steps)``: the micro-batch halved until a step fits, and enough
    micro-batches per optimizer step to keep ``samples_per_step``.

    :param micro_batch: the assigned (largest) micro-batch.
    :param samples_per_step: samples one optimizer step should see.
    :param memory_cap: bytes the step may use; None: 80 % of the free RAM on the CPU, the GPU's memory on CUDA.
    :param probe: measures a step's memory at a micro-batch (default :func:`probe_step`); for tests.
    :param available: free RAM in bytes (default psutil's); for tests.
    """
    import torch

    micro = max(1, micro_batch)
    measure = probe or (lambda m: probe_step(runtime, model, device, m, autocast))
    while True:
        try:
            peak = measure(micro)
        except torch.cuda.OutOfMemoryError:
            peak = math.inf
        limit = memory_cap
        if device.type == "cpu":
            if available is None:
                import psutil

                free = int(psutil.virtual_memory().available)
            else:
                free = available()
            limit = min(memory_cap, free) if memory_cap else int(free * 0.8)
        if limit is None or peak <= limit or micro == 1:
            break
        micro = max(1, micro // 2)
        logger.info("micro-batch lowered to %d to fit in %.1f GiB", micro, (limit or 0) / 2**30)
    return micro, max(1, math.ceil(samples_per_step / micro))
