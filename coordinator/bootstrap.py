"""Opening a data directory: create it, upgrade the store, make sure the signing key and organizer token
exist. ``init`` and ``serve`` both go through :func:`open_data_dir`, so it is idempotent."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from coordinator.accounts.authority import InitResult, TokenAuthority
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store, StoreError

logger = logging.getLogger("coordinator")
# SQLite's companions of a database file: write-ahead log, shared memory index, rollback journal.
_SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


@dataclass
class Opened:
    store: Store
    authority: TokenAuthority
    init: InitResult


def open_data_dir(settings: CoordinatorSettings, *, rotate_admin_token: bool = False) -> Opened:
    data_dir = settings.data_dir
    if data_dir.exists() and not data_dir.is_dir():
        raise StoreError(f"{data_dir} exists and is not a directory")
    try:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        settings.keys_dir.mkdir(exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StoreError(f"cannot create data directory {data_dir}: {exc.strerror}") from exc
    if not os.access(data_dir, os.W_OK):
        raise StoreError(f"data directory {data_dir} is not writable")
    secure_data_dir(settings)
    database = sqlite_path(settings.resolved_database_url)
    if database is not None:
        _create_private(database)
    store = Store(settings.resolved_database_url)
    try:
        store.migrate()
        authority = TokenAuthority(settings=settings, store=store)
        result = authority.initialize(rotate_admin_token=rotate_admin_token)
    except BaseException:
        store.close()
        raise
    secure_data_dir(settings)
    return Opened(store=store, authority=authority, init=result)


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL (None for other databases and in-memory SQLite)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if not parsed.drivername.startswith("sqlite") or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def _create_private(path: Path) -> None:
    """Create an empty database file readable by its owner only, before SQLite creates it 0644; SQLite
    gives its -wal and -shm files the database file's mode."""
    if path.exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreError(f"cannot create the database {path}: {exc.strerror}") from exc


def _tighten(path: Path, mode: int) -> None:
    try:
        current = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return
    if current & ~mode:
        try:
            os.chmod(path, current & mode)
        except OSError as exc:  # not ours (a shared volume): say so, do not refuse to start
            logger.warning("cannot restrict the permissions of %s (%o): %s", path, current, exc.strerror)


def secure_data_dir(settings: CoordinatorSettings) -> None:
    """Owner-only permissions on everything secret: the data, key and swarm directories (0700), the
    organizer token, signing keys, swarm identities and SQLite files (0600). An existing data directory
    made by an older version, or by hand, is tightened too."""
    for directory in (settings.data_dir, settings.keys_dir, settings.swarm_dir):
        _tighten(directory, 0o700)
    _tighten(settings.admin_token_path, 0o600)
    for directory in (settings.keys_dir, settings.swarm_dir):
        if directory.is_dir():
            for path in directory.iterdir():
                if path.is_file():
                    _tighten(path, 0o600)
    database = sqlite_path(settings.resolved_database_url)
    if database is not None:
        for suffix in _SQLITE_SUFFIXES:
            _tighten(database.with_name(database.name + suffix), 0o600)
