"""Alembic environment: always driven programmatically by ``coordinator.store.migrate``.

The caller passes an open connection in ``config.attributes["connection"]``; there is no alembic.ini.
"""

from __future__ import annotations

from alembic import context

from coordinator.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copy-and-move
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
