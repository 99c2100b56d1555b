"""Schema migrations: the models and the migration history agree, and upgrading keeps data."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import select

from coordinator.models import Base, Volunteer
from coordinator.store import Store, head_revision, schema_revision


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
