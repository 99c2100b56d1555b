"""Hardware profiling: CPU, memory, OS and NVIDIA GPUs (via pynvml), without importing torch.

Machines without NVIDIA drivers are normal: the GPU list is simply empty. The task micro-benchmark
(samples per second of the run's training step) runs in a worker subprocess, because only workers
import torch; see :func:`volunteer_app.agent.speedtest.measure_speed`.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import re
from pathlib import Path

import psutil

from volunteer_app.protocol import GpuInfo, HardwareProfile, TaskBenchmark

logger = logging.getLogger(__name__)


def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux, the platform module elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        try:
            for line in cpuinfo.read_text(errors="replace").splitlines():
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
        except OSError:
            pass
    return platform.processor() or platform.machine() or "unknown"


def nvidia_gpus() -> list[GpuInfo]:
    """NVIDIA GPUs seen by the driver; an empty list when there is no driver or no GPU."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml raises NVMLError subclasses (library or driver not found)
        logger.debug("no NVIDIA driver: %s", exc)
        return []
    gpus = []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                capability: str | None = f"{major}.{minor}"
            except Exception:
                capability = None
            gpus.append(
                GpuInfo(
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(memory.total),
                    driver=driver,
                    cuda_capability=capability,
                )
            )
    except Exception as exc:
        logger.warning("could not read NVIDIA GPU details: %s", exc)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return gpus


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def os_name() -> str:
    if platform.system() == "Linux":
        try:
            release = platform.freedesktop_os_release()
            return f"{release.get('PRETTY_NAME', 'Linux')} (kernel {platform.release()})"
        except OSError:
            pass
    return f"{platform.system()} {platform.release()}".strip() or "unknown"


def torch_version() -> str | None:
    """The installed torch version, read from package metadata (torch itself is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def profile_machine(
    *, benchmark: TaskBenchmark | None = None, accepts_connections: bool | None = None
) -> HardwareProfile:
    """Profile this machine. Cheap (well under a second) unless a benchmark is passed in."""
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    return HardwareProfile(
        cpu_model=cpu_model()[:200],
        cpu_cores=physical,
        cpu_threads=logical,
        ram_bytes=int(psutil.virtual_memory().total),
        os=os_name()[:200],
        python=platform.python_version(),
        torch=torch_version(),
        gpus=nvidia_gpus(),
        accepts_connections=accepts_connections,
        benchmark=benchmark,
    )


def describe(profile: HardwareProfile) -> list[str]:
    """Human-readable lines for ``volunteer-app profile``."""
    lines = [
        f"CPU      {profile.cpu_model} ({profile.cpu_cores} cores, {profile.cpu_threads} threads)",
        f"Memory   {profile.ram_bytes / 1024**3:.1f} GiB",
        f"OS       {profile.os}, Python {profile.python}, torch {profile.torch or 'not installed'}",
    ]
    if profile.gpus:
        for gpu in profile.gpus:
            lines.append(
                f"GPU      {gpu.name}, {gpu.memory_bytes / 1024**3:.1f} GiB, driver {gpu.driver or '?'}"
                + (f", compute {gpu.cuda_capability}" if gpu.cuda_capability else "")
            )
    else:
        lines.append("GPU      none found (no NVIDIA driver or GPU); training runs on the CPU")
    if profile.benchmark is not None:
        b = profile.benchmark
        lines.append(
            f"Speed    {b.samples_per_second:.1f} samples/s on {b.task}{f' ({b.preset})' if b.preset else ''}, "
            f"{b.device}, {b.threads} thread(s), micro-batch {b.micro_batch_size}"
        )
    return lines
