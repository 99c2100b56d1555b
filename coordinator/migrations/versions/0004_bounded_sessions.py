"""bounded sessions: compact stored profiles, totals of pruned sessions, indexes for pruning

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-16 09:00:00

Sessions that ended and that nothing must keep are now deleted (``coordinator.retention``); what they had
reported goes to the new ``pruned_totals`` first. Ledger entries and spot checks get an index on their
session, which pruning (and the peers table) look up. Profiles stored before are compacted in place, with
the rule of ``coordinator.retention.stored_profile`` as this revision applies it; the sweeper deletes old
sessions after the upgrade, a batch at a time.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_MAX_GPUS = 16
_TEXT_BYTES = 64


def _clip(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    used = 0
    for index, char in enumerate(value):
        used += len(json.dumps(char)) - 2
        if used > _TEXT_BYTES:
            return value[:index]
    return value


def _compact(profile: dict[str, Any]) -> dict[str, Any]:
    # the rule of coordinator.retention.stored_profile, frozen here as this revision applies it
    gpus = [g for g in profile.get("gpus") or [] if isinstance(g, dict)]
    stored = {
        name: _clip(profile.get(name))
        for name in ("cpu_model", "cpu_cores", "cpu_threads", "ram_bytes", "os", "python", "torch")
        if name in profile
    }
    stored["accepts_connections"] = profile.get("accepts_connections")
    count = profile.get("gpu_count")
    stored["gpu_count"] = count if isinstance(count, int) else len(gpus)
    stored["gpus"] = [
        {"name": _clip(g.get("name", "GPU")), "memory_bytes": g.get("memory_bytes", 0)}
        for g in gpus[:_MAX_GPUS]
    ]
    benchmark = profile.get("benchmark")
    stored["benchmark"] = (
        {name: _clip(value) for name, value in benchmark.items()} if isinstance(benchmark, dict) else None
    )
    return stored


def upgrade() -> None:
    op.create_table(
        "pruned_totals",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("sessions", sa.Integer(), nullable=False),
        sa.Column("leases_returned", sa.Integer(), nullable=False),
        sa.Column("leases_expired", sa.Integer(), nullable=False),
        sa.Column("samples_total", sa.Float(), nullable=False),
        sa.Column("averaging_rounds", sa.Float(), nullable=False),
        sa.Column("bytes", sa.Float(), nullable=False),
        sa.Column("global_epoch", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.PrimaryKeyConstraint("run_id"),
    )
    # Plain CREATE INDEX: on SQLite, batch mode's copy of a table that others refer to fails its FK check.
    op.create_index("ix_ledger_entries_session_id", "ledger_entries", ["session_id"], unique=False)
    op.create_index("ix_spot_checks_session_id", "spot_checks", ["session_id"], unique=False)

    connection = op.get_bind()
    rows = connection.execute(sa.text("SELECT id, profile FROM peer_sessions")).all()
    for session_id, profile in rows:
        loaded = json.loads(profile) if isinstance(profile, str) else profile
        if not isinstance(loaded, dict):
            continue
        compact = _compact(loaded)
        if compact != loaded:
            connection.execute(
                sa.text("UPDATE peer_sessions SET profile = :profile WHERE id = :id"),
                {"profile": json.dumps(compact), "id": session_id},
            )


def downgrade() -> None:
    op.drop_index("ix_spot_checks_session_id", table_name="spot_checks")
    op.drop_index("ix_ledger_entries_session_id", table_name="ledger_entries")
    op.drop_table("pruned_totals")
