"""Words and numbers for the screens: pure functions of the agent's state (and ``now``), so that every
screen says the same thing the same way and the tests can check them without a terminal."""

from __future__ import annotations

import time
from typing import Any

from volunteer_app.control import AgentState, ContributionState, format_duration
from volunteer_app.display import human, human_bytes

__all__ = [
    "advice",
    "age",
    "banner",
    "human",
    "human_bytes",
    "is_contributing",
    "setting_label",
]

# What a volunteer should do next when the agent refuses a command, by the error code it answers.
ADVICE: dict[str, str] = {
    "agent_unreachable": "The agent does not answer. This window reattaches when it is back; press a to start it.",
    "timeout": "The agent is busy; try again in a moment.",
    "refused": "The agent refused this window's token. Close it and run `volunteer-app` again.",
    "bad_answer": "The agent speaks another protocol version: update volunteer-app, then restart it.",
    "not_joined": "Join a run first (press j).",
    "already_joined": "Leave the current run first (press l on the Contribute screen).",
    "not_ready": "The training worker is still starting; try again once it trains.",
    "invalid_coordinator": "Check the coordinator's address, e.g. https://train.example.org.",
    "coordinator_unreachable": "Check the address and your connection; the organizers' server may be down.",
    "run_not_found": "Pick one of the runs listed by the coordinator.",
    "run_finished": "This run has finished; pick another run.",
    "run_paused": "The organizers paused this run; try again later or pick another.",
    "name_taken": "",
    "invalid_name": "",
    "invite_required": "This run is invite-only: enter the invite code the organizers gave you.",
    "invalid_invite_code": "Check the invite code with the organizers.",
    "invalid_setting": "Correct the value; the setting was not changed.",
    "unknown_setting": "This agent is older than this window: update volunteer-app and restart the agent.",
    "worker_failing": "See the Log screen (6) and the worker's log; press c there to save a bug report.",
    "credential_store": "The credential file in the config dir is unreadable; see the Log screen (6).",
    "invalid_message": "This window and the agent disagree: update volunteer-app and restart the agent.",
}


def advice(code: str) -> str:
    """What to do next after the agent answered the error ``code`` ("" where the agent's answer says it)."""
    return ADVICE.get(code, "See the Log screen (6) for details; press c there to save a bug report.")


def refusal(detail: str, code: str) -> str:
    """The agent's refusal and what to do next, as one text."""
    detail = detail.rstrip(". ")
    hint = advice(code)
    return f"{detail[:1].upper()}{detail[1:]}. {hint}".rstrip()


def age(at: float | None, now: float) -> str:
    """``12 s ago``, ``4 min ago``, ``2 h 05 min ago``; ``never`` for None."""
    if at is None:
        return "never"
    seconds = now - at
    if seconds < 5:
        return "just now"
    return f"{format_duration(seconds)} ago"


def is_contributing(state: AgentState | None) -> bool:
    """Whether the agent has a run it is in (joining, training, paused or stopping), as opposed to idle."""
    c = state.contribution if state is not None else None
    return c is not None and c.state not in ("stopped", "failed")


def pause_reasons(state: AgentState) -> list[str]:
    c = state.contribution
    if c is not None and c.pause_reasons:
        return list(c.pause_reasons)
    return list(state.policy.reasons)


def banner(state: AgentState | None, *, attached: bool, now: float | None = None) -> tuple[str, str]:
    """One line about the agent for the top of every screen, and its style class
    (``ok``, ``paused``, ``busy``, ``idle`` or ``error``)."""
    now = time.time() if now is None else now
    if not attached or state is None:
        return (
            "The agent is not running: training has stopped on this machine. Press a to start it; "
            "this window reattaches by itself.",
            "error",
        )
    c = state.contribution
    if state.state == "stopping":
        return "The agent is stopping…", "busy"
    if c is None or c.state in ("stopped", "failed"):
        if c is not None and c.state == "failed":
            return (
                f"Not contributing: {c.last_error or 'the contribution failed'}. Press j to join again.",
                "error",
            )
        return "Not contributing to any run. Press j to join one.", "idle"
    where = f"run {c.run} as {c.name}"
    if c.state in ("starting", "registering", "profiling", "joining") or state.state == "joining":
        return f"Joining {where}: {c.state}…", "busy"
    reasons = pause_reasons(state)
    if state.state == "paused" or c.state == "paused" or reasons:
        why = "; ".join(reasons) or "paused"
        if state.snoozed_until is not None:
            return (
                f"Snoozed ({why}); resumes in {format_duration(state.snoozed_until - now)}, r resumes now",
                "paused",
            )
        if c.finishing:
            return f"Finishing the current lease, then pausing ({why})", "paused"
        hint = " · r resumes" if c.paused_by == "volunteer" or state.paused_by_user else ""
        return f"Paused: {why}{hint}", "paused"
    if c.finishing:
        return f"Finishing the current lease of {where}, then pausing", "busy"
    if c.state == "syncing":
        return f"Downloading the shared model for {where}…", "busy"
    if c.state in ("waiting", "restarting"):
        return f"Contributing to {where}: {c.state} ({c.last_error or 'the worker restarts'})", "busy"
    if not c.coordinator_ok:
        return f"Training {where}; the coordinator is unreachable (reports wait in the outbox)", "busy"
    return f"Contributing to {where}", "ok"


def lease_text(c: ContributionState) -> str:
    if c.lease_id is None:
        return "none (training on unleased shards)" if c.samples_unleased else "none"
    return f"shard {c.lease_shard}: {c.lease_samples_done}/{c.lease_samples}, {c.leases_in_hand} in hand"


def device_text(c: ContributionState) -> str:
    parts = [c.device or "?"]
    if c.threads:
        parts.append(f"{c.threads} thread{'s' if c.threads != 1 else ''}")
    if c.micro_batch_size:
        parts.append(f"batch {c.micro_batch_size}")
    return " · ".join(parts)


def setting_label(key: str) -> str:
    """``pause_when_cpu_busy_percent`` -> ``Pause when CPU busy (%)``."""
    words = key.split("_")
    unit = ""
    if words[-1] in ("percent", "c", "gb", "minutes"):
        unit = {"percent": "%", "c": "°C", "gb": "GB", "minutes": "min"}[words[-1]]
        words = words[:-1]
    text = " ".join(words)
    for short, shown in (("cpu", "CPU"), ("gpu", "GPU"), ("temp", "temperature")):
        text = " ".join(shown if w == short else w for w in text.split())
    text = text[:1].upper() + text[1:]
    return f"{text} ({unit})" if unit else text


def shown_value(value: Any) -> str:
    """A setting's value as the settings screen's input shows it."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "; ".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
