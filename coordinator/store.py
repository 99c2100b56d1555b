"""The store: a SQLAlchemy engine, schema migrations, and read/write units of work.

SQLite (the default) runs in WAL mode so that readers never wait for the writer. Writes take a
process-wide lock and ``BEGIN IMMEDIATE`` so that two writers never deadlock on a lock upgrade; other
processes (``volunteer-coordinator runs create`` while ``serve`` runs) wait up to ``busy_timeout``.
PostgreSQL (``--database-url postgresql+psycopg://…``) uses ordinary transactions.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


class StoreError(RuntimeError):
    """The database cannot be opened or upgraded; the message says which and why."""


def make_engine(url: str) -> Engine:
    try:
        if url.startswith("sqlite"):
            engine = create_engine(
                url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=20, max_overflow=20
            )

            @event.listens_for(engine, "connect")
            def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
                cursor = dbapi_connection.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.execute("PRAGMA foreign_keys=ON")
                cursor.execute("PRAGMA busy_timeout=30000")
                cursor.close()

            return engine
        return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=20)
    except (ArgumentError, ImportError, ValueError) as exc:
        raise StoreError(f"cannot use database URL: {exc}") from exc


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision; existing data is kept (upgrades only add or convert)."""
    config = _alembic_config()
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    except OperationalError as exc:
        raise StoreError(f"cannot open or upgrade the store: {exc.orig}") from exc


def schema_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


class Store:
    """Opens the database and hands out units of work.

    Use ``with store.read() as db:`` for queries and ``with store.write() as db:`` for changes; a write
    commits when the block ends and rolls back if it raises.
    """

    def __init__(self, url: str, *, engine: Engine | None = None):
        self.url = url
        self.engine = engine or make_engine(url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def migrate(self) -> None:
        migrate(self.engine)

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._sessions() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        with self._write_lock, self._sessions() as session:
            if self.is_sqlite:
                session.connection().exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def close(self) -> None:
        self.engine.dispose()
