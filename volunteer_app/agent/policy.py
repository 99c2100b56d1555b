"""When this machine may compute: the resource policy, a pure function.

:func:`decide` maps (settings, sensor readings, the clock, the volunteer's own pause/snooze, what it
remembered last time) to a :class:`~volunteer_app.control.PolicyDecision`: compute or not, every reason
why not, whether the GPU may be used, and the thread limit. It reads no sensor and no clock itself, so it
is tested by tables (``tests/volunteer_app/test_policy.py``); the agent samples the sensors every few
seconds and applies each decision to the worker.

The rules, each modelled on what volunteers asked BOINC and Folding@home for:

* the volunteer's pause, and snooze for a while (BOINC #1429); start paused (F@H #360);
* other programs' CPU use above a limit (BOINC's "suspend when non-BOINC CPU usage is above");
* only when idle: no keyboard/mouse input for N minutes where the platform reports it, else other
  programs' CPU below a threshold for N minutes (the decision says which is in force);
* battery: pause on battery, and/or below a level with resume above another (BOINC #5310);
* a weekly schedule of allowed windows;
* heat: pause above a CPU or GPU temperature, resume a few degrees below (BOINC #6246, #7104);
* the GPU alone: suspended by the volunteer, while listed programs (games) run, or when hot
  (BOINC #1429, #1459).

Absent sensors are reported as absent in ``notes``, never guessed: a rule that needs a sensor the
machine lacks does not pause it, and says so.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from volunteer_app.control import (
    DAYS,
    PolicyDecision,
    PolicyMemory,
    PolicySettings,
    SensorReadings,
    parse_window,
)


def decide(
    *,
    settings: PolicySettings,
    readings: SensorReadings,
    now: datetime,
    memory: PolicyMemory | None = None,
    paused_by_user: bool = False,
    snoozed_until: float | None = None,
    worker_on_gpu: bool = False,
) -> PolicyDecision:
    """The policy's verdict for this moment.

    :param now: local, timezone-aware wall-clock time (the schedule is in local time).
    :param memory: what the previous decision remembered (hysteresis); None on the first call.
    :param worker_on_gpu: whether the worker trains on the GPU (GPU rules then pause the worker).
    """
    memory = memory or PolicyMemory()
    remembered = PolicyMemory()
    reasons: list[str] = []
    gpu_reasons: list[str] = []
    notes: list[str] = []
    timestamp = now.timestamp()

    if paused_by_user:
        reasons.append("paused by you")
    if snoozed_until is not None and timestamp < snoozed_until:
        until = datetime.fromtimestamp(snoozed_until, tz=now.tzinfo)
        reasons.append(
            f"snoozed until {until:%H:%M}" + (f" on {until:%a}" if until.date() != now.date() else "")
        )

    window = _schedule_reason(settings.schedule, now)
    if window is not None:
        reasons.append(window)

    _battery(settings, readings, memory, remembered, reasons, notes)

    other = readings.other_cpu_percent
    if settings.pause_when_cpu_busy_percent is not None:
        if other is None:
            notes.append("CPU use of other programs: not readable on this machine")
        elif other > settings.pause_when_cpu_busy_percent:
            reasons.append(
                f"other programs use {other:.0f}% of the CPU (limit {settings.pause_when_cpu_busy_percent:.0f}%)"
            )

    idle_detection = "off"
    if settings.only_when_idle:
        idle_detection = _idle(settings, readings, memory, remembered, timestamp, reasons, notes)

    remembered.cpu_hot = _hot(
        "CPU", readings.cpu_temp_c, settings.max_cpu_temp_c, settings.temp_resume_margin_c, memory.cpu_hot,
        reasons, notes,
    )  # fmt: skip

    gpu_temp = max(readings.gpu_temps_c) if readings.gpu_temps_c else None
    if settings.max_gpu_temp_c is not None and gpu_temp is None and readings.gpu_readable:
        notes.append("GPU temperature: not reported by the driver")
    remembered.gpu_hot = _hot(
        "GPU", gpu_temp, settings.max_gpu_temp_c, settings.temp_resume_margin_c, memory.gpu_hot,
        gpu_reasons, notes if readings.gpu_readable else [],
    )  # fmt: skip
    if settings.gpu_suspended:
        gpu_reasons.insert(0, "GPU suspended by you")
    if readings.exclusive_apps_running:
        gpu_reasons.append(f"GPU suspended while {', '.join(readings.exclusive_apps_running)} runs")
    gpu_allowed = not gpu_reasons
    if worker_on_gpu and not gpu_allowed:
        reasons.extend(gpu_reasons)

    return PolicyDecision(
        compute=not reasons,
        reasons=reasons,
        gpu_allowed=gpu_allowed,
        gpu_reasons=gpu_reasons,
        threads=settings.max_threads,
        idle_detection=idle_detection,  # type: ignore[arg-type]
        notes=notes,
        memory=remembered,
    )


def _battery(
    settings: PolicySettings,
    readings: SensorReadings,
    memory: PolicyMemory,
    remembered: PolicyMemory,
    reasons: list[str],
    notes: list[str],
) -> None:
    wants_battery = settings.pause_on_battery or settings.battery_pause_below is not None
    if readings.on_battery is None:
        if wants_battery and readings.battery_percent is None:
            notes.append("battery: none found (a desktop, or not reported)")
        return
    if settings.pause_on_battery and readings.on_battery:
        reasons.append("running on battery")
    below = settings.battery_pause_below
    if below is None or readings.battery_percent is None:
        return
    resume = settings.battery_resume_above if settings.battery_resume_above is not None else below
    level = readings.battery_percent
    low = level < below or (memory.battery_low and level <= resume)
    remembered.battery_low = low
    if low:
        again = f"; resumes above {resume:.0f}%" if resume > below else ""
        reasons.append(f"battery at {level:.0f}% (pauses below {below:.0f}%{again})")


def _idle(
    settings: PolicySettings,
    readings: SensorReadings,
    memory: PolicyMemory,
    remembered: PolicyMemory,
    timestamp: float,
    reasons: list[str],
    notes: list[str],
) -> str:
    needed = settings.idle_minutes * 60
    if readings.input_idle_seconds is not None:
        idle_for = readings.input_idle_seconds
        if idle_for < needed:
            reasons.append(
                f"the computer is in use (input {_ago(idle_for)} ago; computing after "
                f"{settings.idle_minutes:g} min without input)"
            )
        return "input"
    other = readings.other_cpu_percent
    notes.append("idle detection: by CPU load (this system does not report keyboard/mouse input)")
    if other is None:
        notes.append("idle detection: CPU load not readable either; treated as idle")
        return "load"
    if other < settings.idle_cpu_percent:
        since = memory.idle_since if memory.idle_since is not None else timestamp
        remembered.idle_since = since
        if timestamp - since < needed:
            reasons.append(
                f"waiting for the computer to be idle (other programs under {settings.idle_cpu_percent:g}% CPU for "
                f"{settings.idle_minutes:g} min; {_ago(timestamp - since)} so far)"
            )
    else:
        reasons.append(
            f"the computer is in use (other programs use {other:.0f}% of the CPU; idle means under "
            f"{settings.idle_cpu_percent:g}% for {settings.idle_minutes:g} min)"
        )
    return "load"


def _hot(
    what: str,
    temperature: float | None,
    limit: float | None,
    margin: float,
    was_hot: bool,
    reasons: list[str],
    notes: list[str],
) -> bool:
    if limit is None:
        return False
    if temperature is None:
        notes.append(f"{what} temperature: no sensor readable on this machine")
        return False
    hot = temperature > limit or (was_hot and temperature > limit - margin)
    if hot:
        reasons.append(
            f"{what} at {temperature:.0f} °C (limit {limit:.0f} °C; resumes below {limit - margin:.0f} °C)"
        )
    return hot


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def in_schedule(windows: list[str], now: datetime) -> bool:
    """Whether ``now`` falls into one of the weekly windows (an empty schedule allows any time)."""
    if not windows:
        return True
    minute = now.hour * 60 + now.minute
    weekday = now.weekday()
    for text in windows:
        days, start, end = parse_window(text)
        if start < end:
            if weekday in days and start <= minute < end:
                return True
        else:  # past midnight: the evening part on the listed day, the morning part on the day after
            if weekday in days and minute >= start:
                return True
            if (weekday - 1) % 7 in days and minute < end:
                return True
    return False


def next_window_start(windows: list[str], now: datetime) -> datetime | None:
    """When the schedule next opens after ``now`` (None for an empty schedule, which never closes)."""
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    starts = []
    for text in windows:
        days, start, _end = parse_window(text)
        for offset in range(8):
            day = midnight + timedelta(days=offset)
            candidate = day + timedelta(minutes=start)
            if day.weekday() in days and candidate > now:
                starts.append(candidate)
    return min(starts, default=None)


def _schedule_reason(windows: list[str], now: datetime) -> str | None:
    if in_schedule(windows, now):
        return None
    start = next_window_start(windows, now)
    if start is None:
        return "outside the schedule"
    day = "" if start.date() == now.date() else f"{DAYS[start.weekday()]} "
    return f"outside the schedule (next window {day}{start:%H:%M})"
