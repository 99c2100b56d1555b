"""The states of runs, sessions, shards, leases, spot checks and workers are spelled once
(``volunteer_app.states``): the wire protocol's Literal types list exactly the enums' values."""

from __future__ import annotations

from typing import get_args

from volunteer_app import protocol, worker_protocol
from volunteer_app.states import (
    HeartbeatWorkerState,
    RunState,
    RunStateName,
    WorkerState,
    WorkerStateName,
    heartbeat_state,
)


def test_the_wire_spells_each_state_as_its_enum_does() -> None:
    assert set(get_args(RunStateName)) == {s.value for s in RunState}
    assert set(get_args(WorkerStateName)) == {s.value for s in WorkerState}
    assert set(get_args(HeartbeatWorkerState)) == {s.value for s in WorkerState} - {"stopped"}
    assert protocol.RunState is RunStateName
    assert worker_protocol.WorkerStateName is WorkerStateName


def test_a_state_is_its_value_everywhere() -> None:
    assert RunState.FINISHED == "finished" and f"{RunState.FINISHED}" == "finished"
    assert str(WorkerState.TRAINING) == "training"


def test_the_agents_own_steps_are_starting_to_the_coordinator() -> None:
    for step in ("registering", "profiling", "downloading", "joining", "restarting", "stopped", "failed"):
        assert heartbeat_state(step) == "starting"
    for state in ("syncing", "training", "paused", "waiting", "stopping"):
        assert heartbeat_state(state) == state
