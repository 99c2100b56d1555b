"""The resource policy, rule by rule and in combination, by tables: settings + readings + clock -> verdict."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from volunteer_app.agent.policy import decide, in_schedule, next_window_start
from volunteer_app.control import PolicyMemory, PolicySettings, SensorReadings, parse_window

UTC = timezone.utc
# Wednesday 2026-12-02 14:30 UTC
WEDNESDAY = datetime(2026, 12, 2, 14, 30, tzinfo=UTC)
DESKTOP = {"cpu_percent": 10.0, "volunteer_cpu_percent": 5.0}


def verdict(settings: dict[str, Any], readings: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("now", WEDNESDAY)
    return decide(settings=PolicySettings(**settings), readings=SensorReadings(**readings), **kwargs)


CASES = [
    # (name, settings, readings, extra kwargs, compute?, a phrase every reason list must contain)
    ("defaults on a desktop compute", {}, DESKTOP, {}, True, None),
    ("the volunteer's pause", {}, DESKTOP, {"paused_by_user": True}, False, "paused by you"),
    (
        "a snooze in force",
        {},
        DESKTOP,
        {"snoozed_until": WEDNESDAY.timestamp() + 600},
        False,
        "snoozed until 14:40",
    ),
    ("a snooze that is over", {}, DESKTOP, {"snoozed_until": WEDNESDAY.timestamp() - 1}, True, None),
    (
        "on battery pauses by default",
        {},
        {**DESKTOP, "on_battery": True, "battery_percent": 80},
        {},
        False,
        "running on battery",
    ),
    (
        "on battery allowed",
        {"pause_on_battery": False},
        {**DESKTOP, "on_battery": True, "battery_percent": 80},
        {},
        True,
        None,
    ),
    (
        "battery low",
        {"pause_on_battery": False, "battery_pause_below": 30},
        {**DESKTOP, "on_battery": True, "battery_percent": 20},
        {},
        False,
        "battery at 20% (pauses below 30%",
    ),
    (
        "plugged in, battery charging past the level",
        {"battery_pause_below": 30},
        {**DESKTOP, "on_battery": False, "battery_percent": 35},
        {},
        True,
        None,
    ),
    (
        "other programs busy",
        {"pause_when_cpu_busy_percent": 50},
        {"cpu_percent": 90.0, "volunteer_cpu_percent": 30.0},
        {},
        False,
        "other programs use 60% of the CPU",
    ),
    (
        "our own CPU does not count as busy",
        {"pause_when_cpu_busy_percent": 50},
        {"cpu_percent": 95.0, "volunteer_cpu_percent": 90.0},
        {},
        True,
        None,
    ),
    (
        "in use by input",
        {"only_when_idle": True, "idle_minutes": 5},
        {**DESKTOP, "input_idle_seconds": 30},
        {},
        False,
        "the computer is in use (input 30 s ago",
    ),
    (
        "idle by input",
        {"only_when_idle": True, "idle_minutes": 5},
        {**DESKTOP, "input_idle_seconds": 600},
        {},
        True,
        None,
    ),
    (
        "in use by load (no input sensor)",
        {"only_when_idle": True},
        {"cpu_percent": 70.0, "volunteer_cpu_percent": 10.0},
        {},
        False,
        "other programs use 60% of the CPU",
    ),
    (
        "outside the schedule",
        {"schedule": ["mon-fri 18:00-23:00"]},
        DESKTOP,
        {},
        False,
        "outside the schedule (next window 18:00)",
    ),
    ("inside the schedule", {"schedule": ["wed 14:00-15:00"]}, DESKTOP, {}, True, None),
    (
        "an overnight window, morning part",
        {"schedule": ["tue 22:00-08:00"]},
        DESKTOP,
        {"now": WEDNESDAY.replace(hour=7)},
        True,
        None,
    ),
    (
        "CPU too hot",
        {"max_cpu_temp_c": 80},
        {**DESKTOP, "cpu_temp_c": 91},
        {},
        False,
        "CPU at 91 °C (limit 80 °C; resumes below 75 °C)",
    ),
    ("CPU cool enough", {"max_cpu_temp_c": 80}, {**DESKTOP, "cpu_temp_c": 60}, {}, True, None),
    (
        "GPU suspended, worker on the CPU",
        {"gpu_suspended": True},
        DESKTOP,
        {"worker_on_gpu": False},
        True,
        None,
    ),
    (
        "GPU suspended, worker on the GPU",
        {"gpu_suspended": True},
        DESKTOP,
        {"worker_on_gpu": True},
        False,
        "GPU suspended by you",
    ),
    (
        "a game runs, worker on the GPU",
        {"gpu_exclusive_apps": ["steam"]},
        {**DESKTOP, "exclusive_apps_running": ["steam"]},
        {"worker_on_gpu": True},
        False,
        "GPU suspended while steam runs",
    ),
    (
        "GPU too hot",
        {"max_gpu_temp_c": 80},
        {**DESKTOP, "gpu_temps_c": [85.0], "gpu_readable": True},
        {"worker_on_gpu": True},
        False,
        "GPU at 85 °C",
    ),
]


@pytest.mark.parametrize(
    ("name", "settings", "readings", "extra", "compute", "phrase"), CASES, ids=[c[0] for c in CASES]
)
def test_each_rule(
    name: str,
    settings: dict[str, Any],
    readings: dict[str, Any],
    extra: dict[str, Any],
    compute: bool,
    phrase: str | None,
) -> None:
    decision = verdict(settings, readings, **extra)
    assert decision.compute is compute, decision.reasons
    if phrase is None:
        assert decision.reasons == []
    else:
        assert any(phrase in reason for reason in decision.reasons), decision.reasons


def test_every_reason_is_listed_when_several_rules_pause() -> None:
    decision = verdict(
        {"max_cpu_temp_c": 80, "schedule": ["mon 00:00-01:00"]},
        {**DESKTOP, "on_battery": True, "battery_percent": 50, "cpu_temp_c": 95},
        paused_by_user=True,
    )
    assert not decision.compute
    assert len(decision.reasons) == 4
    assert decision.reasons[0] == "paused by you"


@pytest.mark.parametrize(
    ("readings", "was_hot", "hot"),
    [(82.0, False, True), (78.0, False, False), (78.0, True, True), (74.0, True, False)],
)
def test_temperature_resumes_only_a_margin_below_the_limit(readings: float, was_hot: bool, hot: bool) -> None:
    decision = verdict(
        {"max_cpu_temp_c": 80, "temp_resume_margin_c": 5},
        {**DESKTOP, "cpu_temp_c": readings},
        memory=PolicyMemory(cpu_hot=was_hot),
    )
    assert decision.compute is not hot
    assert decision.memory.cpu_hot is hot


@pytest.mark.parametrize(
    ("level", "was_low", "paused"),
    [(25, False, True), (35, False, False), (35, True, True), (45, True, False)],
)
def test_battery_pauses_below_one_level_and_resumes_above_another(
    level: float, was_low: bool, paused: bool
) -> None:
    decision = verdict(
        {"pause_on_battery": False, "battery_pause_below": 30, "battery_resume_above": 40},
        {**DESKTOP, "on_battery": True, "battery_percent": level},
        memory=PolicyMemory(battery_low=was_low),
    )
    assert decision.compute is not paused


def test_idle_by_load_needs_the_quiet_to_last() -> None:
    settings = {"only_when_idle": True, "idle_minutes": 2, "idle_cpu_percent": 15}
    quiet = {"cpu_percent": 8.0, "volunteer_cpu_percent": 0.0}
    first = verdict(settings, quiet)
    assert not first.compute and "waiting for the computer to be idle" in first.reasons[0]
    assert first.idle_detection == "load"
    assert any("by CPU load" in note for note in first.notes), (
        "the verdict must say which idle test is in force"
    )
    later = verdict(settings, quiet, now=WEDNESDAY + timedelta(minutes=3), memory=first.memory)
    assert later.compute
    busy = verdict(settings, {"cpu_percent": 50.0}, now=WEDNESDAY + timedelta(minutes=4), memory=later.memory)
    assert not busy.compute and busy.memory.idle_since is None


def test_input_idle_is_preferred_and_named() -> None:
    decision = verdict({"only_when_idle": True}, {**DESKTOP, "input_idle_seconds": 1000})
    assert decision.idle_detection == "input"
    assert not any("CPU load" in note for note in decision.notes)


@pytest.mark.parametrize(
    ("settings", "readings", "note"),
    [
        ({"max_cpu_temp_c": 80}, DESKTOP, "CPU temperature: no sensor readable"),
        ({"pause_when_cpu_busy_percent": 50}, {}, "CPU use of other programs: not readable"),
        ({"battery_pause_below": 20}, DESKTOP, "battery: none found"),
    ],
)
def test_absent_sensors_are_reported_never_guessed(
    settings: dict[str, Any], readings: dict[str, Any], note: str
) -> None:
    decision = verdict(settings, readings)
    assert decision.compute, "a rule without its sensor must not pause the machine"
    assert any(note in n for n in decision.notes), decision.notes


def test_thread_limit_passes_through() -> None:
    assert verdict({"max_threads": 3}, DESKTOP).threads == 3
    assert verdict({}, DESKTOP).threads is None


@pytest.mark.parametrize(
    ("windows", "when", "inside"),
    [
        (["mon-fri 09:00-17:00"], datetime(2026, 12, 5, 10, 0, tzinfo=UTC), False),  # Saturday
        (["sat,sun all"], datetime(2026, 12, 5, 10, 0, tzinfo=UTC), True),
        (["daily 22:00-06:00"], datetime(2026, 12, 7, 5, 59, tzinfo=UTC), True),
        (["daily 22:00-06:00"], datetime(2026, 12, 7, 6, 0, tzinfo=UTC), False),
        (
            ["fri-mon 20:00-23:00"],
            datetime(2026, 12, 7, 21, 0, tzinfo=UTC),
            True,
        ),  # Monday, a wrapping day range
        ([], datetime(2026, 12, 7, 3, 0, tzinfo=UTC), True),
    ],
)
def test_schedule_windows(windows: list[str], when: datetime, inside: bool) -> None:
    assert in_schedule(windows, when) is inside


def test_next_window_is_found_across_days() -> None:
    start = next_window_start(["mon 08:00-09:00"], WEDNESDAY)
    assert start is not None and start.weekday() == 0 and start.hour == 8
    assert verdict({"schedule": ["mon 08:00-09:00"]}, DESKTOP).reasons == [
        "outside the schedule (next window mon 08:00)"
    ]


@pytest.mark.parametrize("bad", ["weekdays 9-5", "mon 09:00-09:00", "funday all", "mon-fri 25:00-26:00"])
def test_bad_schedule_windows_are_refused_with_an_example(bad: str) -> None:
    with pytest.raises(ValueError, match=r"e\.g\.|unknown day|same time|not a time"):
        parse_window(bad)
    with pytest.raises(ValueError):
        PolicySettings(schedule=[bad])
