"""Memory fitting: whether a run's model fits this machine at all, and the largest micro-batch that does.

A coordinator's config alone sizes the model, so before anything is allocated the worker (and the speed
test) counts the model's parameters on PyTorch's ``meta`` device, which allocates nothing, and refuses a
model whose training needs more than the volunteer's memory limit (:func:`check_model_fits`); the limit is
also set on the process by the operating system (:func:`cap_process_memory`), so that a model that grows
past the estimate fails an allocation instead of taking the computer's memory.

Then the micro-batch:

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

BYTES_PER_PARAMETER = 24
"""Host memory one parameter takes while training on the CPU: its fp32 value (4), gradient (4), AdamW's two
moments (8), and hivemind's averaged copy of it with its all-reduce buffer (8)."""
GPU_BYTES_PER_PARAMETER = 16
"""GPU memory one parameter takes while training on a GPU: value, gradient and AdamW's two moments."""
PROCESS_BYTES = 384 * 2**20
"""What the worker process holds before its model: the Python interpreter, torch and hivemind take ~300 MiB
(measured on Linux, torch 2.13 CPU), plus the allocator's slack."""
RLIMIT_HEADROOM_BYTES = 2 * 2**30
"""Added to the memory limit for the operating system's cap (``RLIMIT_DATA`` counts the address space of
thread stacks and allocator arenas, which is reserved but mostly never touched)."""


class ModelTooBig(Exception):
    """The run's model needs more memory than this machine lets training use; the message says how much."""


def count_parameters(runtime: Any) -> int:
    """The parameters of ``runtime``'s model, counted on the ``meta`` device (no memory is allocated)."""
    import torch

    with torch.device("meta"):
        model = runtime.build_model()
    return int(sum(p.numel() for p in model.parameters()))


def training_bytes(parameters: int) -> int:
    """Host memory training a model of ``parameters`` needs at least (activations come on top: the micro-batch
    shrinks to fit them, :func:`fit_micro_batch`)."""
    return PROCESS_BYTES + BYTES_PER_PARAMETER * parameters


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


def check_model_fits(runtime: Any, *, limit_bytes: int | None, device: Any = "cpu") -> int:
    """The model's parameter count, after checking that training it fits ``limit_bytes`` of host memory
    (and, on a GPU, the GPU's memory).

    :raises ModelTooBig: with what the model needs, what is allowed, and what the volunteer can do.
    """
    import torch

    parameters = count_parameters(runtime)
    needed = training_bytes(parameters)
    if limit_bytes is not None and needed > limit_bytes:
        raise ModelTooBig(
            f"the run's model has {parameters / 1e6:.1f}M parameters and needs about {_gb(needed)} of memory "
            f"to train; this computer lets training use {_gb(limit_bytes)} (volunteer-app settings "
            "max_memory_gb, or 80 % of the RAM): not training it"
        )
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        gpu_needed = GPU_BYTES_PER_PARAMETER * parameters
        if gpu_needed > 0.9 * total:
            raise ModelTooBig(
                f"the run's model has {parameters / 1e6:.1f}M parameters and needs about {_gb(gpu_needed)} of "
                f"GPU memory; the GPU has {_gb(total)}: not training it"
            )
    return parameters


def cap_process_memory(limit_bytes: int | None, *, device: str = "cpu") -> int | None:
    """Have the operating system cap this process's data memory near ``limit_bytes`` (Linux's
    ``RLIMIT_DATA``: an allocation past it fails); returns the cap set, or None where none could be.

    Processes forked afterwards (hivemind's helpers) inherit the cap. On systems without ``RLIMIT_DATA``
    enforcement (macOS, Windows) the model check above is the only guard, and so it is for training on a
    GPU: the CUDA driver maps large regions of address space, and address-space limits are known to make
    its initialisation fail, so a ``cuda`` process is not capped (not yet tried on a GPU with this cap)."""
    if limit_bytes is None or device != "cpu":
        return None
    try:
        import resource
    except ImportError:
        return None
    cap = int(limit_bytes) + RLIMIT_HEADROOM_BYTES
    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("could not cap this process's memory: %s", exc)
        return None
    return cap


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
