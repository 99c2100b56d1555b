"""Schema migrations: the models and the migration history agree, and upgrading keeps data."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import select

from coordinator.models import Base, Volunteer
from coordinator.store import Store, head_revision, schema_revision

# Rows written with the columns of the migrations before 0004, as the tables stood then.
INSERT_RUN_R1 = (
    "INSERT INTO runs (id, name, task, task_config, optimizer, description, visibility, state, "
    "data_epochs, current_data_epoch, num_shards, samples_per_shard, hivemind_run_id, swarm_port, "
    "swarm_maddrs, created_at, updated_at) VALUES ('r1', 'shapes', 'shapes-dalle', '{}', '{}', '', "
    "'open', 'active', 1, 0, 4, 64, 'va-shapes', 0, '[]', 1.0, 1.0)"
)
INSERT_CREDENTIALS = "INSERT INTO credentials (id, kind, volunteer_id, secret_hash, created_at) VALUES "
INSERT_PEER_SESSION = (
    "INSERT INTO peer_sessions (id, run_id, volunteer_id, credential_id, peer_public_key, "
    "agent_version, profile, assignment, state, worker_state, paused_by_coordinator, created_at, "
    "last_heartbeat_at, token_expires_at, max_samples_per_second, samples_total, "
    "samples_per_second, local_epoch, global_epoch, swarm_size, averaging_rounds, bytes_sent, "
    "bytes_received, flagged_heartbeats) VALUES "
)


def test_migrations_build_exactly_the_models(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    with store.engine.connect() as connection:
        diff = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
        )
    assert diff == [], f"models changed without a migration: {diff}"
    assert schema_revision(store.engine) == head_revision()
    store.close()


def test_upgrading_again_keeps_every_row(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    store = Store(url)
    store.migrate()
    with store.write() as db:
        db.add(Volunteer(id="v1", name="alice", created_at=1.0))
    store.close()
    again = Store(url)
    again.migrate()
    with again.read() as db:
        assert [v.name for v in db.scalars(select(Volunteer))] == ["alice"]
    with again.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    again.close()


def test_upgrading_from_0001_keys_names_owns_peer_keys_and_clamps_hostile_counters(tmp_path: Path) -> None:
    """A database from before issue 10: two names differing in case, a peer key used by one volunteer,
    and a session counter a hostile peer pushed to 2**63-1 (it broke every run page)."""
    from alembic import command
    from sqlalchemy import text

    from coordinator.accounts.volunteers import register
    from coordinator.models import PeerKey, PeerSession
    from coordinator.store import _alembic_config
    from volunteer_app.protocol import RegisterRequest

    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    config = _alembic_config()
    with store.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0001")
        connection.execute(
            text(
                "INSERT INTO volunteers (id, name, created_at) VALUES "
                "('v1', 'alice', 1.0), ('v2', 'Alice', 2.0), ('v3', 'bob.', 3.0)"
            )
        )
        connection.execute(text(INSERT_RUN_R1))
        connection.execute(
            text(
                INSERT_CREDENTIALS
                + "('c1', 'volunteer', 'v1', 'h1', 1.0), ('c2', 'volunteer', 'v2', 'h2', 2.0)"
            )
        )
        for sid, volunteer, credential, created in (("s1", "v1", "c1", 10.0), ("s2", "v2", "c2", 20.0)):
            connection.execute(
                text(
                    INSERT_PEER_SESSION + "(:sid, 'r1', :v, :c, 'ssh-rsa AAAAkey', 't', '{}', "
                    "'{}', 'left', 'training', 0, :t, :t, :t, 10.0, 9223372036854775807, 0, 0, 0, 0, 0, 0, 0, 0)"
                ),
                {"sid": sid, "v": volunteer, "c": credential, "t": created},
            )
    store.migrate()
    with store.read() as db:
        keys = {v.name: v.name_key for v in db.scalars(select(Volunteer))}
        assert keys == {"alice": "alice", "Alice": "alice~v2", "bob.": "bob"}
        (owner,) = db.scalars(select(PeerKey)).all()
        assert owner.volunteer_id == "v1"  # the first to join with it
        assert {s.samples_total for s in db.scalars(select(PeerSession))} == {10**15}
    with store.write() as db:  # and the rule holds from now on
        try:
            register(db, request=RegisterRequest(name="BOB"))
        except Exception as exc:
            assert getattr(exc, "code", None) == "name_taken"
        else:
            raise AssertionError("BOB registered beside bob.")
    store.close()


def test_upgrading_to_0004_compacts_the_profiles_stored_before(tmp_path: Path) -> None:
    """Sessions stored before defect 8's fix kept the whole profile a peer sent (26 KB and more)."""
    import json

    from alembic import command
    from sqlalchemy import text

    from coordinator.credit.ledger import rate_ceiling
    from coordinator.models import PeerSession
    from coordinator.retention import STORED_PROFILE_MAX_BYTES
    from coordinator.settings import CoordinatorSettings
    from coordinator.store import _alembic_config

    gpus = [{"name": "G" * 200, "memory_bytes": 1, "driver": "D" * 100, "cuda_capability": "9.0"}] * 64
    hostile = {"cpu_model": "C" * 200, "cpu_cores": 2, "cpu_threads": 4, "ram_bytes": 1, "os": "é" * 200}
    hostile["gpus"] = gpus
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    config = _alembic_config()
    with store.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0003")
        connection.execute(
            text("INSERT INTO volunteers (id, name, name_key, created_at) VALUES ('v1', 'a', 'a', 1)")
        )
        connection.execute(text(INSERT_RUN_R1))
        connection.execute(text(INSERT_CREDENTIALS + "('c1', 'volunteer', 'v1', 'h1', 1.0)"))
        connection.execute(
            text(
                INSERT_PEER_SESSION + "('s1', 'r1', 'v1', 'c1', 'ssh-rsa AAAAkey', 't', "
                ":profile, '{\"device\": \"cuda\"}', 'left', 'training', 0, 1, 1, 1, 10.0, 0, 0, 0, 0, 0, 0, "
                "0, 0, 0)"
            ),
            {"profile": json.dumps(hostile)},
        )
    store.migrate()
    with store.read() as db:
        size = db.scalar(text("SELECT length(CAST(profile AS TEXT)) FROM peer_sessions"))
        session = db.scalars(select(PeerSession)).one()
    assert size is not None and size <= STORED_PROFILE_MAX_BYTES < len(json.dumps(hostile))
    profile = session.profile
    assert profile["gpu_count"] == 64 and len(profile["gpus"]) == 16
    assert profile["cpu_model"] == "C" * 64 and profile["cpu_cores"] == 2
    # the GPU count still sets the throughput ceiling (capped at max_credited_gpus)
    settings = CoordinatorSettings()
    assert rate_ceiling(profile=profile, assignment={"device": "cuda"}, settings=settings) == (
        settings.credit.max_credited_gpus * settings.credit.gpu_max_samples_per_second
    )
    store.close()
