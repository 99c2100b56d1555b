"""Reading the machine for the resource policy: CPU use (ours and everyone else's), keyboard/mouse idle
time, battery, CPU and GPU temperatures, running programs. psutil and pynvml; nothing is guessed: a
value the platform does not report stays None and the policy says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import psutil

from volunteer_app.control import SensorReadings

logger = logging.getLogger(__name__)

# psutil names of CPU temperature sensors, most specific first (Intel, AMD, ARM SoCs, ACPI).
_CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "soc_thermal", "acpitz")


class Sensors:
    """Samples the machine. Keep one instance: CPU percentages are measured between two calls.

    :param own_pids: returns the pids of this agent's worker processes (their CPU is not "other programs").
    """

    def __init__(self, own_pids: Callable[[], Iterable[int]] = lambda: ()):
        self._own_pids = own_pids
        self._procs: dict[int, psutil.Process] = {}
        self._nvml = _Nvml()
        self._idle = _input_idle_reader()
        psutil.cpu_percent(None)  # start the first interval

    def read(self, *, exclusive_apps: list[str] | None = None) -> SensorReadings:
        total = psutil.cpu_percent(None)
        ours = self._volunteer_cpu()
        on_battery, battery = _battery()
        return SensorReadings(
            at=time.time(),
            cpu_percent=total,
            volunteer_cpu_percent=ours,
            input_idle_seconds=self._idle(),
            on_battery=on_battery,
            battery_percent=battery,
            cpu_temp_c=cpu_temperature(),
            gpu_temps_c=self._nvml.temperatures(),
            gpu_readable=self._nvml.available,
            exclusive_apps_running=running_programs(exclusive_apps) if exclusive_apps else [],
        )

    def _volunteer_cpu(self) -> float:
        """CPU of this agent and its workers (with their helpers), in % of the whole machine."""
        pids = {os.getpid()}
        for pid in self._own_pids():
            pids.add(pid)
            with contextlib.suppress(psutil.Error):
                pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        total = 0.0
        for pid in list(self._procs):
            if pid not in pids:
                del self._procs[pid]
        for pid in pids:
            process = self._procs.get(pid)
            try:
                if process is None:
                    process = self._procs[pid] = psutil.Process(pid)
                    process.cpu_percent(None)  # first call starts its interval
                    continue
                total += process.cpu_percent(None)
            except psutil.Error:
                self._procs.pop(pid, None)
        return total / (psutil.cpu_count() or 1)

    def close(self) -> None:
        self._nvml.close()


def _battery() -> tuple[bool | None, float | None]:
    try:
        battery = psutil.sensors_battery()
    except (AttributeError, NotImplementedError, OSError):
        return None, None
    if battery is None:
        return None, None
    on_battery = None if battery.power_plugged is None else not battery.power_plugged
    return on_battery, float(battery.percent)


def cpu_temperature() -> float | None:
    """The hottest CPU package/core sensor psutil knows, or None (no sensor, or not Linux/FreeBSD)."""
    reader = getattr(psutil, "sensors_temperatures", None)
    if reader is None:
        return None
    try:
        sensors = reader()
    except (OSError, RuntimeError):
        return None
    for name in _CPU_SENSORS:
        readings = [t.current for t in sensors.get(name, []) if t.current and 0 < t.current < 150]
        if readings:
            return max(readings)
    return None


def running_programs(names: list[str]) -> list[str]:
    """Which of ``names`` (process names, case-insensitive, ``.exe`` optional) are running now."""
    wanted = {n.lower().removesuffix(".exe"): n for n in names}
    found: set[str] = set()
    for process in psutil.process_iter(["name"]):
        name = (process.info.get("name") or "").lower().removesuffix(".exe")
        if name in wanted:
            found.add(wanted[name])
    return sorted(found)


class _Nvml:
    """GPU temperatures through pynvml; unavailable (not an error) without an NVIDIA driver."""

    def __init__(self) -> None:
        self.available = False
        self._pynvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
            self.available = True
        except Exception as exc:  # no library, no driver, no GPU: all normal
            logger.debug("GPU sensors unavailable: %s", exc)

    def temperatures(self) -> list[float]:
        if self._pynvml is None:
            return []
        nvml = self._pynvml
        temps = []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                with contextlib.suppress(Exception):
                    temps.append(float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)))
        except Exception as exc:
            logger.debug("reading GPU temperatures failed: %s", exc)
        return temps

    def close(self) -> None:
        if self._pynvml is not None:
            with contextlib.suppress(Exception):
                self._pynvml.nvmlShutdown()
            self._pynvml = None


def _input_idle_reader() -> Callable[[], float | None]:
    """A function returning seconds since the last keyboard/mouse input, or None where unknowable.

    Windows: ``GetLastInputInfo``. macOS: ``HIDIdleTime`` from ``ioreg``. Linux with an X11 display: the
    XScreenSaver extension (libXss). Elsewhere (Wayland, a server, a container) there is no portable
    source, and the policy falls back to CPU load.
    """
    if sys.platform == "win32":
        return _windows_idle
    if sys.platform == "darwin":
        return _macos_idle
    if os.environ.get("DISPLAY"):
        reader = _x11_idle_reader()
        if reader is not None:
            return reader
    return lambda: None


def _windows_idle() -> float | None:
    class LastInputInfo(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LastInputInfo()
    info.cbSize = ctypes.sizeof(info)
    windll = getattr(ctypes, "windll", None)
    if windll is None or not windll.user32.GetLastInputInfo(ctypes.byref(info)):
        return None
    return max(0.0, (windll.kernel32.GetTickCount() - info.dwTime) / 1000.0)


def _macos_idle() -> float | None:
    try:
        out = subprocess.run(
            ["ioreg", "-c", "IOHIDSystem", "-d", "4"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', out)
    return int(match.group(1)) / 1e9 if match else None


def _x11_idle_reader() -> Callable[[], float | None] | None:
    xlib_path, xss_path = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
    if not xlib_path or not xss_path:
        return None
    try:
        xlib, xss = ctypes.cdll.LoadLibrary(xlib_path), ctypes.cdll.LoadLibrary(xss_path)
    except OSError:
        return None

    class XScreenSaverInfo(ctypes.Structure):
        _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                    ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong), ("eventMask", ctypes.c_ulong)]  # fmt: skip

    xlib.XOpenDisplay.restype = ctypes.c_void_p
    xlib.XDefaultRootWindow.restype = ctypes.c_ulong
    xlib.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
    xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(XScreenSaverInfo)
    xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(XScreenSaverInfo)]
    display = xlib.XOpenDisplay(None)
    if not display:
        return None
    info = xss.XScreenSaverAllocInfo()

    def read() -> float | None:
        if not xss.XScreenSaverQueryInfo(display, xlib.XDefaultRootWindow(display), info):
            return None
        return info.contents.idle / 1000.0

    return read
