"""The per-peer assignment policy: how one volunteer's machine trains, from its profile and limits.

One torch-free module used by both sides: the coordinator derives the assignment it hands out at join
(``coordinator.sessions``), and the agent uses the same rules to choose the device, threads and
micro-batch of its speed test, so that the speed measured is the speed the assignment will run at.
"""

from __future__ import annotations

from dataclasses import dataclass

from volunteer_app.protocol import HardwareProfile, OptimizerSettings, PeerAssignment

# Below this many bytes of GPU memory, keep optimizer state in host memory (offload) to fit the model.
SMALL_GPU_BYTES = 6 * 1024**3
# A CPU peer calls Optimizer.step about once per this many samples: each call writes a signed progress
# record to the DHT, so batching micro-batches saves helper-process CPU (measured: 0.67 -> 0.81 efficiency).
CPU_SAMPLES_PER_STEP = 64
# Micro-batch before the speed test has said anything better.
DEFAULT_CPU_MICRO_BATCH = 16
DEFAULT_GPU_MICRO_BATCH = 64
# A GPU peer feeds the GPU with this many CPU threads at most (data generation, optimizer offload).
GPU_PEER_THREADS = 2


class AssignmentError(ValueError):
    """The volunteer asked for something this machine does not have (``device='cuda'`` without a GPU)."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ComputePlan:
    """Where and how wide this machine computes: what the speed test measures and the assignment uses."""

    device: str  # "cuda" or "cpu"
    threads: int
    micro_batch_size: int


def compute_plan(*, profile: HardwareProfile, max_threads: int | None, device: str) -> ComputePlan:
    """The device, threads and starting micro-batch for this machine under the volunteer's limits."""
    has_gpu = bool(profile.gpus)
    if device == "cuda" and not has_gpu:
        raise AssignmentError(
            "device 'cuda' was asked for but the profile lists no NVIDIA GPU", field="device"
        )
    use_gpu = has_gpu and device in ("auto", "cuda")
    threads = profile.cpu_cores if max_threads is None else min(profile.cpu_cores, max_threads)
    threads = max(1, threads)
    if use_gpu:
        return ComputePlan("cuda", min(threads, GPU_PEER_THREADS), DEFAULT_GPU_MICRO_BATCH)
    return ComputePlan("cpu", threads, DEFAULT_CPU_MICRO_BATCH)


def derive_assignment(
    *, profile: HardwareProfile, optimizer: OptimizerSettings, max_threads: int | None, device: str
) -> PeerAssignment:
    """Per-peer settings from the profile and the volunteer's limits.

    CPU peers: one thread per physical core up to the volunteer's limit, micro-batches accumulated to
    about 64 samples per optimizer step, optimizer on the same device, no delayed step (a background
    step would steal the cores that train). GPU peers: AMP, delayed optimizer step and gradient averaging
    overlapped with compute, optimizer state offloaded to host memory on small GPUs.

    :raises AssignmentError: ``device='cuda'`` on a profile without a GPU.
    """
    plan = compute_plan(profile=profile, max_threads=max_threads, device=device)
    benchmark = profile.benchmark
    micro_batch = plan.micro_batch_size
    if benchmark is not None and benchmark.device == plan.device:
        micro_batch = benchmark.micro_batch_size
    client_mode = profile.accepts_connections is False
    if plan.device == "cuda":
        memory = min(g.memory_bytes for g in profile.gpus)
        return PeerAssignment(
            device="cuda",
            threads=plan.threads,
            micro_batch_size=micro_batch,
            accumulation_steps=1,
            client_mode=client_mode,
            amp=True,
            offload_optimizer=memory < SMALL_GPU_BYTES,
            delay_optimizer_step=not optimizer.use_local_updates,
        )
    return PeerAssignment(
        device="cpu",
        threads=plan.threads,
        micro_batch_size=micro_batch,
        accumulation_steps=max(1, CPU_SAMPLES_PER_STEP // micro_batch),
        client_mode=client_mode,
        amp=False,
        offload_optimizer=False,
        delay_optimizer_step=False,
    )
