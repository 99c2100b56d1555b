"""The coordinator on PostgreSQL: the same migrations and the same API flow as on SQLite.

Runs when ``VOLUNTEER_TEST_POSTGRES_URL`` names an empty database the test may fill, e.g.
``postgresql+psycopg://postgres@127.0.0.1/volunteer_test`` (``.ci/run`` starts a server for it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import text

from coordinator.api import create_app
from coordinator.models import Base
from coordinator.store import Store
from tests.conftest import bearer, create_run_over_http, register_and_join, settings_for

URL = os.environ.get("VOLUNTEER_TEST_POSTGRES_URL")
pytestmark = pytest.mark.skipif(not URL, reason="set VOLUNTEER_TEST_POSTGRES_URL to test on PostgreSQL")


@pytest.fixture
def database() -> str:
    assert URL is not None
    store = Store(URL)
    with store.engine.begin() as connection:  # start from an empty database
        connection.execute(text("DROP SCHEMA public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    store.close()
    return URL


def test_migrations_match_the_models_on_postgres(database: str) -> None:
    store = Store(database)
    store.migrate()
    store.migrate()  # idempotent
    with store.engine.connect() as connection:
        diff = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
        )
    assert diff == []
    store.close()


def test_api_flow_on_postgres(database: str, tmp_path: Path) -> None:
    settings = settings_for(tmp_path, database_url=SecretStr(database))
    with TestClient(create_app(settings)) as client:
        admin_token = settings.admin_token_path.read_text().strip()
        admin = bearer(admin_token)
        create_run_over_http(client, admin_token, {"num_shards": 3, "samples_per_shard": 32}, name="pg")
        credential, _, joined = register_and_join(client, "ada", tmp_path / "peer.rsa", run="pg")
        join = joined.json()
        beat = client.post(
            f"/api/v1/sessions/{join['session_id']}/heartbeat",
            json={"state": "training", "samples_total": 32, "samples_per_second": 10.0, "loss": 2.0},
            headers=bearer(credential),
        )
        assert beat.status_code == 200, beat.text
        time.sleep(0.5)
        lease = join["lease"]["lease_id"]
        for _ in range(2):
            done = client.post(
                f"/api/v1/sessions/{join['session_id']}/leases/{lease}/complete",
                json={"samples": 32, "compute_seconds": 0.4},
                headers=bearer(credential),
            )
            assert done.status_code == 200 and done.json()["credited_samples"] == 32
        board = client.get("/api/v1/runs/pg/leaderboard").json()["entries"]
        assert [(e["volunteer"], e["samples"]) for e in board] == [("ada", 32)]
        banned = client.post("/api/v1/volunteers/ada/ban", json={}, headers=admin).json()
        assert banned["sessions_revoked"] == 1
        assert client.get("/api/v1/health").json()["database"] == "postgresql"


def test_rejoins_and_the_sweeper_delete_ended_sessions_on_postgres(database: str, tmp_path: Path) -> None:
    """Pruning deletes with RETURNING and adds to the run's totals with an upsert: both dialect-specific."""
    from sqlalchemy import func, select

    from coordinator.models import PeerSession, PrunedTotals
    from coordinator.settings import WorkSettings
    from tests.coordinator.conftest import make_clocked

    work = WorkSettings(ended_session_retention=60.0)
    for c in make_clocked(tmp_path, database_url=SecretStr(database), work=work):
        c.create_run()
        ada = c.register("ada")
        for _ in range(3):  # each re-join replaces the session before and deletes it
            joined = c.join(ada)
            assert c.heartbeat(ada, joined["session_id"], samples_total=32).status_code == 200
        other = c.join(ada, peer_public_key=c.new_key()[1])  # a second worker; the first falls silent
        c.clock.advance(c.settings.work.session_timeout + 120.0)
        assert c.heartbeat(ada, other["session_id"]).status_code == 200
        swept = c.sweep()  # the silent one: lost, its lease expired, silent past the retention: deleted
        assert (swept.lost, swept.pruned) == (1, 1)
        resources = c.client.app.state.resources  # type: ignore[attr-defined]
        with resources.store.read() as db:
            assert db.scalar(select(func.count()).select_from(PeerSession)) == 1
            totals = db.scalars(select(PrunedTotals)).one()
            assert (totals.sessions, totals.leases_returned, totals.leases_expired) == (3, 2, 1)
            assert totals.samples_total == 96.0
        stats = c.client.get("/api/v1/runs/shapes").json()["stats"]
        assert stats["samples_total"] == 96 and stats["volunteers"] == 1
