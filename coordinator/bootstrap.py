"""Opening a data directory: create it, upgrade the store, make sure the signing key and organizer token
exist. ``init`` and ``serve`` both go through :func:`open_data_dir`, so it is idempotent."""

from __future__ import annotations

import os
from dataclasses import dataclass

from coordinator.authority import InitResult, TokenAuthority
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store, StoreError


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
    store = Store(settings.resolved_database_url)
    try:
        store.migrate()
        authority = TokenAuthority(settings=settings, store=store)
        result = authority.initialize(rotate_admin_token=rotate_admin_token)
    except BaseException:
        store.close()
        raise
    return Opened(store=store, authority=authority, init=result)
