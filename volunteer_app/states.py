"""Every state a run, a session, a shard, a lease, a spot check or a worker can be in: one place, both sides.

The coordinator stores these as strings (their values); the wire protocol carries the same strings; the
agent and the worker use the same names. Each is a ``str`` enum, so a member equals its value
(``RunState.ACTIVE == "active"``), prints as it (``f"{state}"`` is ``active``), and is stored and sent as
it. Stdlib only: the web process, the agent and the worker all import it.

How each moves:

* :class:`RunState`: ``active`` <-> ``paused`` (the organizers), then ``finished`` (by them, or when the
  last data epoch's shards are done); finished is final.
* :class:`SessionState` (one worker's membership in a run): ``active`` from the join; ``lost`` when its
  heartbeats stop (a heartbeat makes it ``active`` again); ``left`` when it leaves or joins again;
  ``stopped`` when the organizers ban the volunteer (refused from then on).
* :class:`ShardState`: ``pending`` -> ``leased`` -> ``claimed`` (a lease on it completed, not yet confirmed
  by the swarm's records) -> ``done`` (verified); an expired or returned lease, or a failed spot check,
  puts it back to ``pending``.
* :class:`LeaseState`: ``active`` -> ``completed`` (reported), ``returned`` (given back) or ``expired``
  (its deadline passed).
* :class:`SpotCheckState`: ``pending`` -> ``running`` -> ``passed`` or ``failed``; ``expired`` when nobody
  decided it in time.
* :class:`WorkerState` (what the training worker does, reported in its events and the agent's
  heartbeats): ``starting`` -> ``syncing`` -> ``training``, ``paused`` or ``waiting`` (no lease),
  ``stopping`` -> ``stopped`` (the worker's last word; never in a heartbeat).
"""

from __future__ import annotations

from enum import Enum
from typing import Literal


class _StrEnum(str, Enum):
    """A ``str`` enum that formats as its value on every Python this project supports (3.10's ``str, Enum``
    mix-in formats as ``Class.MEMBER`` in ``str()``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class RunState(_StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    FINISHED = "finished"


class SessionState(_StrEnum):
    ACTIVE = "active"
    LOST = "lost"
    LEFT = "left"
    STOPPED = "stopped"


class ShardState(_StrEnum):
    PENDING = "pending"
    LEASED = "leased"
    CLAIMED = "claimed"
    DONE = "done"


class LeaseState(_StrEnum):
    ACTIVE = "active"
    COMPLETED = "completed"
    RETURNED = "returned"
    EXPIRED = "expired"


class SpotCheckState(_StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    EXPIRED = "expired"


class WorkerState(_StrEnum):
    STARTING = "starting"
    SYNCING = "syncing"
    TRAINING = "training"
    PAUSED = "paused"
    WAITING = "waiting"
    STOPPING = "stopping"
    STOPPED = "stopped"


# The same values as Literal types, for the wire protocol's pydantic fields (tests/test_states.py checks
# that each lists exactly its enum's values).
RunStateName = Literal["active", "paused", "finished"]
WorkerStateName = Literal["starting", "syncing", "training", "paused", "waiting", "stopping", "stopped"]
HeartbeatWorkerState = Literal["starting", "syncing", "training", "paused", "waiting", "stopping"]
"""What a heartbeat may report: a :class:`WorkerState` but ``stopped`` (a stopped worker sends none)."""

OPEN_SPOT_CHECK_STATES = (SpotCheckState.PENDING, SpotCheckState.RUNNING)
ENDED_SESSION_STATES = (SessionState.LEFT, SessionState.STOPPED)


def heartbeat_state(state: str) -> HeartbeatWorkerState:
    """The worker state a heartbeat reports for the agent's contribution state ``state``.

    The agent's own states before and between workers (registering, profiling, downloading, joining,
    restarting) are all ``starting`` to the coordinator: no worker trains yet."""
    try:
        worker = WorkerState(state)
    except ValueError:
        return "starting"
    return "starting" if worker is WorkerState.STOPPED else worker.value
