"""Coordinator fixtures with an injected clock, and a stand-in for the run's swarm peer.

Leases have minimum durations and credit depends on what the swarm saw and when, so these tests move a
:class:`FakeClock` instead of sleeping. The swarm peer's part (reading a peer's signed progress record
from the DHT) is played with :func:`swarm_sees`, which writes exactly what ``coordinator.swarm`` writes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.api import create_app
from coordinator.credit.ledger import record_sighting
from coordinator.models import PeerSession
from coordinator.settings import CoordinatorSettings, CreditSettings
from tests.conftest import Coordinator, Volunteer, settings_for

SMALL = {"preset": "tiny", "d_model": 32, "n_heads": 2, "n_layers": 1, "eval_prompts": 4, "eval_samples": 8}
"""A shapes-dalle model small enough to train a step of in a test."""


def write_shapes_checkpoint(
    data_dir: Path,
    task_config: dict[str, Any],
    *,
    epoch: int,
    samples: int,
    recorded_config: dict[str, Any] | None = None,
) -> Any:
    """Train a shapes-dalle model of ``task_config`` on shard 0 and save it as run ``shapes``' checkpoint
    of ``epoch``, as the run's checkpointer does. The checkpoint records ``recorded_config`` (default:
    the config as the task writes it out)."""
    from coordinator.checkpoints import CheckpointStore, checkpoint_directory
    from coordinator.swarm.checkpointer import save_checkpoint
    from workers.optim import adamw
    from workers.tasks import load_task

    spec = load_task("shapes-dalle")
    config = spec.make_config(task_config)
    runtime: Any = spec.build_runtime(config)
    model = runtime.build_model()
    optimizer = adamw(runtime.param_groups(model), lr=3e-3)
    for batch in runtime.shard_batches(0, batch_size=16, seed=0):
        runtime.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return save_checkpoint(
        CheckpointStore(checkpoint_directory(data_dir, "shapes")),
        runtime=runtime,
        model=model,
        optimizer=optimizer,
        epoch=epoch,
        run="shapes",
        task="shapes-dalle",
        task_config=spec.config_to_dict(config) if recorded_config is None else recorded_config,
        metric="prompt_accuracy",
        samples=samples,
    )


class FakeClock:
    """Unix time that moves only when a test says so (starts at the real time, so tokens stay valid)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass
class Clocked(Coordinator):
    clock: FakeClock = None  # type: ignore[assignment]

    def complete(
        self, volunteer: Volunteer, session_id: str, lease_id: str, samples: int, **body: Any
    ) -> Any:
        body.setdefault("compute_seconds", 1.0)
        return self.client.post(
            f"/api/v1/sessions/{session_id}/leases/{lease_id}/complete",
            json={"samples": samples, **body},
            headers=volunteer.headers,
        )

    def take(self, volunteer: Volunteer, session_id: str) -> Any:
        return self.client.post(f"/api/v1/sessions/{session_id}/leases", headers=volunteer.headers)

    def board(self, run: str = "shapes") -> list[dict[str, Any]]:
        return self.client.get(f"/api/v1/runs/{run}/leaderboard").json()["entries"]

    def sweep(self) -> Any:
        from coordinator.sessions import sweep

        resources = self.client.app.state.resources  # type: ignore[attr-defined]
        with resources.store.write() as db:
            return sweep(db, settings=self.settings, now=self.clock())


def swarm_sees(
    c: Coordinator,
    session_id: str,
    *,
    epoch: int = 0,
    samples_per_second: float = 50.0,
    now: float | None = None,
) -> None:
    """Play the run's swarm peer reading this session's signed progress record from the DHT."""
    resources = c.client.app.state.resources  # type: ignore[attr-defined]
    with resources.store.write() as db:
        session = db.get(PeerSession, session_id)
        assert session is not None
        record_sighting(
            db,
            session=session,
            now=resources.clock() if now is None else now,
            samples_per_second=samples_per_second,
            epoch=epoch,
        )


CLIENT_HEADER = "X-Test-Client"
"""With ``make_clocked(..., addresses=True)``: the client address a request comes from (default 'testclient')."""


class FromAddresses:
    """The app as seen from several client addresses: a request's ``X-Test-Client`` header becomes its peer
    address, as if it came from that host. Only this test wrapper reads the header; the coordinator sees
    the address in the ASGI scope, where uvicorn puts the peer's (or a trusted proxy's) address."""

    def __init__(self, app: Any):
        self.app = app

    @property
    def state(self) -> Any:
        return self.app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            for name, value in scope["headers"]:
                if name.decode("latin-1").lower() == CLIENT_HEADER.lower():
                    scope = {**scope, "client": (value.decode("latin-1"), 50000)}
        await self.app(scope, receive, send)


def make_clocked(
    tmp_path: Path,
    *,
    spot_check_fraction: float = 0.0,
    seed: int = 0,
    addresses: bool = False,
    **overrides: Any,
) -> Iterator[Clocked]:
    """A coordinator on a :class:`FakeClock`; with ``addresses``, requests may name their client address
    (:data:`CLIENT_HEADER`)."""
    credit = overrides.pop("credit", None) or CreditSettings(spot_check_fraction=spot_check_fraction)
    settings: CoordinatorSettings = settings_for(tmp_path, credit=credit, **overrides)
    clock = FakeClock()
    app: Any = create_app(settings, clock=clock, rng=random.Random(seed))
    with TestClient(FromAddresses(app) if addresses else app) as client:
        admin = settings.admin_token_path.read_text().strip()
        yield Clocked(client=client, settings=settings, tmp_path=tmp_path, admin_token=admin, clock=clock)


@pytest.fixture
def clocked(tmp_path: Path) -> Iterator[Clocked]:
    yield from make_clocked(tmp_path)
