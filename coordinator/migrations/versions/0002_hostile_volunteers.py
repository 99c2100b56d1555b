"""hostile volunteers: name keys, peer-key ownership, current peer token, spot checks, flags

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-09 10:00:00

Existing data is kept: every volunteer gets the key of its name (a later duplicate that differs only in
case keeps its name but gets a key of its own, so that both can still sign in), every peer key goes to
the first volunteer who joined with it, and counters that a hostile peer pushed past what requests may
carry now are clamped (they broke the run statistics).
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_MAX_SAMPLES_TOTAL = 10**15
_MAX_COUNT = 2**53 - 1


def _name_key(name: str) -> str:
    # the same rule as coordinator.volunteers.name_key, frozen here as this revision applies it
    return name.strip().lower().rstrip("._-")


def upgrade() -> None:
    # Plain ADD COLUMN and CREATE INDEX only: on SQLite, recreating a table that other tables' rows refer
    # to (batch mode's copy-and-move) fails its foreign-key check.
    connection = op.get_bind()
    op.add_column(
        "volunteers", sa.Column("name_key", sa.String(length=80), nullable=False, server_default="")
    )
    taken: set[str] = set()
    rows = connection.execute(sa.text("SELECT id, name FROM volunteers ORDER BY created_at, id")).all()
    for volunteer_id, name in rows:
        key = _name_key(name)
        if key in taken:
            key = f"{key}~{volunteer_id[:12]}"
        taken.add(key)
        connection.execute(
            sa.text("UPDATE volunteers SET name_key = :key WHERE id = :id"), {"key": key, "id": volunteer_id}
        )
    op.create_index("uq_volunteers_name_key", "volunteers", ["name_key"], unique=True)
    if connection.dialect.name != "sqlite":  # SQLite keeps the harmless default (dropping it means a copy)
        op.alter_column("volunteers", "name_key", server_default=None)

    op.add_column("peer_sessions", sa.Column("token_hash", sa.String(length=64), nullable=True))
    op.add_column("peer_sessions", sa.Column("epoch_at_join", sa.Integer(), nullable=True))
    connection.execute(
        sa.text("UPDATE peer_sessions SET samples_total = :cap WHERE samples_total > :cap"),
        {"cap": _MAX_SAMPLES_TOTAL},
    )
    for column in ("bytes_sent", "bytes_received"):
        connection.execute(
            sa.text(f"UPDATE peer_sessions SET {column} = :cap WHERE {column} > :cap"), {"cap": _MAX_COUNT}
        )

    op.add_column("leases", sa.Column("not_before", sa.Float(), nullable=True))

    op.create_table(
        "peer_keys",
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("first_used_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["volunteer_id"], ["volunteers.id"]),
        sa.PrimaryKeyConstraint("fingerprint"),
    )
    with op.batch_alter_table("peer_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_peer_keys_volunteer_id"), ["volunteer_id"], unique=False)
    owners: dict[str, tuple[str, float]] = {}
    sessions = connection.execute(
        sa.text("SELECT peer_public_key, volunteer_id, created_at FROM peer_sessions ORDER BY created_at, id")
    ).all()
    for public_key, volunteer_id, created_at in sessions:
        fingerprint = hashlib.sha256(public_key.strip().encode("utf-8")).hexdigest()
        owners.setdefault(fingerprint, (volunteer_id, created_at))
    if owners:
        connection.execute(
            sa.text("INSERT INTO peer_keys (fingerprint, volunteer_id, first_used_at) VALUES (:f, :v, :t)"),
            [{"f": f, "v": v, "t": t} for f, (v, t) in owners.items()],
        )

    op.create_table(
        "spot_checks",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("lease_id", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=32), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("data_epoch", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("micro_batch_size", sa.Integer(), nullable=False),
        sa.Column("reported_loss", sa.Float(), nullable=True),
        sa.Column("model_epoch", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("claimed_at", sa.Float(), nullable=True),
        sa.Column("decided_at", sa.Float(), nullable=True),
        sa.Column("recomputed_loss", sa.Float(), nullable=True),
        sa.Column("detail", sa.String(length=500), nullable=True),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"]),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.ForeignKeyConstraint(["session_id"], ["peer_sessions.id"]),
        sa.ForeignKeyConstraint(["volunteer_id"], ["volunteers.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("lease_id"),
    )
    with op.batch_alter_table("spot_checks", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_spot_checks_run_id"), ["run_id"], unique=False)
        batch_op.create_index("ix_spot_checks_run_state", ["run_id", "state"], unique=False)
        batch_op.create_index(batch_op.f("ix_spot_checks_volunteer_id"), ["volunteer_id"], unique=False)

    op.create_table(
        "flags",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=32), nullable=True),
        sa.Column("lease_id", sa.String(length=32), nullable=True),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("detail", sa.String(length=500), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.ForeignKeyConstraint(["volunteer_id"], ["volunteers.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("flags", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_flags_run_id"), ["run_id"], unique=False)
        batch_op.create_index("ix_flags_session_kind", ["session_id", "kind"], unique=False)
        batch_op.create_index(batch_op.f("ix_flags_volunteer_id"), ["volunteer_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("flags", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_flags_volunteer_id"))
        batch_op.drop_index("ix_flags_session_kind")
        batch_op.drop_index(batch_op.f("ix_flags_run_id"))
    op.drop_table("flags")
    with op.batch_alter_table("spot_checks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_spot_checks_volunteer_id"))
        batch_op.drop_index("ix_spot_checks_run_state")
        batch_op.drop_index(batch_op.f("ix_spot_checks_run_id"))
    op.drop_table("spot_checks")
    with op.batch_alter_table("peer_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_peer_keys_volunteer_id"))
    op.drop_table("peer_keys")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("not_before")
    with op.batch_alter_table("peer_sessions", schema=None) as batch_op:
        batch_op.drop_column("epoch_at_join")
        batch_op.drop_column("token_hash")
    op.drop_index("uq_volunteers_name_key", table_name="volunteers")
    with op.batch_alter_table("volunteers", schema=None) as batch_op:
        batch_op.drop_column("name_key")
