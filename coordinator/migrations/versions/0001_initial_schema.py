"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-12-02 14:10:58.414489
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("task", sa.String(length=200), nullable=False),
        sa.Column("task_config", sa.JSON(), nullable=False),
        sa.Column("optimizer", sa.JSON(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("visibility", sa.String(length=16), nullable=False),
        sa.Column("invite_code_hash", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("data_epochs", sa.Integer(), nullable=False),
        sa.Column("current_data_epoch", sa.Integer(), nullable=False),
        sa.Column("num_shards", sa.Integer(), nullable=False),
        sa.Column("samples_per_shard", sa.Integer(), nullable=False),
        sa.Column("hivemind_run_id", sa.String(length=80), nullable=False),
        sa.Column("swarm_port", sa.Integer(), nullable=False),
        sa.Column("swarm_maddrs", sa.JSON(), nullable=False),
        sa.Column("swarm_updated_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "signing_keys",
        sa.Column("kid", sa.String(length=32), nullable=False),
        sa.Column("public_key", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("retired_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("kid"),
    )
    op.create_table(
        "volunteers",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=True),
        sa.Column("banned_at", sa.Float(), nullable=True),
        sa.Column("ban_reason", sa.String(length=500), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "credentials",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=True),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.Column("last_used_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("secret_hash"),
    )
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_credentials_volunteer_id"), ["volunteer_id"], unique=False)

    op.create_table(
        "revocations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
        ),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("session_id"),
    )
    with op.batch_alter_table("revocations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_revocations_run_id"), ["run_id"], unique=False)

    op.create_table(
        "run_members",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("joined_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
        ),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
        ),
        sa.PrimaryKeyConstraint("run_id", "volunteer_id"),
    )
    op.create_table(
        "shards",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("data_epoch", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("lease_id", sa.String(length=32), nullable=True),
        sa.Column("done_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
        ),
        sa.PrimaryKeyConstraint("run_id", "data_epoch", "shard"),
    )
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.create_index("ix_shards_run_epoch_state", ["run_id", "data_epoch", "state"], unique=False)

    op.create_table(
        "peer_sessions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("credential_id", sa.String(length=32), nullable=False),
        sa.Column("peer_public_key", sa.Text(), nullable=False),
        sa.Column("agent_version", sa.String(length=40), nullable=False),
        sa.Column("profile", sa.JSON(), nullable=False),
        sa.Column("assignment", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("worker_state", sa.String(length=16), nullable=False),
        sa.Column("paused_by_coordinator", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_heartbeat_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("token_expires_at", sa.Float(), nullable=False),
        sa.Column("max_samples_per_second", sa.Float(), nullable=False),
        sa.Column("samples_total", sa.BigInteger(), nullable=False),
        sa.Column("samples_per_second", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("local_epoch", sa.Integer(), nullable=False),
        sa.Column("global_epoch", sa.Integer(), nullable=False),
        sa.Column("swarm_size", sa.Integer(), nullable=False),
        sa.Column("averaging_rounds", sa.Integer(), nullable=False),
        sa.Column("bytes_sent", sa.BigInteger(), nullable=False),
        sa.Column("bytes_received", sa.BigInteger(), nullable=False),
        sa.Column("flagged_heartbeats", sa.Integer(), nullable=False),
        sa.Column("dht_seen_at", sa.Float(), nullable=True),
        sa.Column("dht_samples_per_second", sa.Float(), nullable=True),
        sa.Column("dht_epoch", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["credential_id"],
            ["credentials.id"],
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
        ),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("peer_sessions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_peer_sessions_run_id"), ["run_id"], unique=False)
        batch_op.create_index("ix_peer_sessions_run_state", ["run_id", "state"], unique=False)
        batch_op.create_index(batch_op.f("ix_peer_sessions_volunteer_id"), ["volunteer_id"], unique=False)

    op.create_table(
        "leases",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=32), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("data_epoch", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("issued_at", sa.Float(), nullable=False),
        sa.Column("deadline", sa.Float(), nullable=False),
        sa.Column("completed_at", sa.Float(), nullable=True),
        sa.Column("samples_claimed", sa.Integer(), nullable=True),
        sa.Column("samples_credited", sa.Integer(), nullable=True),
        sa.Column("compute_seconds", sa.Float(), nullable=True),
        sa.Column("flagged", sa.Boolean(), nullable=False),
        sa.Column("flag_reason", sa.String(length=500), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["peer_sessions.id"],
        ),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_leases_run_id"), ["run_id"], unique=False)
        batch_op.create_index("ix_leases_run_state_deadline", ["run_id", "state", "deadline"], unique=False)
        batch_op.create_index(batch_op.f("ix_leases_session_id"), ["session_id"], unique=False)

    op.create_table(
        "ledger_entries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("volunteer_id", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=32), nullable=False),
        sa.Column("lease_id", sa.String(length=32), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("samples_claimed", sa.BigInteger(), nullable=False),
        sa.Column("compute_seconds", sa.Float(), nullable=False),
        sa.Column("verified", sa.Boolean(), nullable=False),
        sa.Column("flagged", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["lease_id"],
            ["leases.id"],
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["peer_sessions.id"],
        ),
        sa.ForeignKeyConstraint(
            ["volunteer_id"],
            ["volunteers.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("lease_id", name="uq_ledger_entries_lease_id"),
    )
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ledger_entries_run_id"), ["run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_ledger_entries_volunteer_id"), ["volunteer_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ledger_entries_volunteer_id"))
        batch_op.drop_index(batch_op.f("ix_ledger_entries_run_id"))

    op.drop_table("ledger_entries")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_leases_session_id"))
        batch_op.drop_index("ix_leases_run_state_deadline")
        batch_op.drop_index(batch_op.f("ix_leases_run_id"))

    op.drop_table("leases")
    with op.batch_alter_table("peer_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_peer_sessions_volunteer_id"))
        batch_op.drop_index("ix_peer_sessions_run_state")
        batch_op.drop_index(batch_op.f("ix_peer_sessions_run_id"))

    op.drop_table("peer_sessions")
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.drop_index("ix_shards_run_epoch_state")

    op.drop_table("shards")
    op.drop_table("run_members")
    with op.batch_alter_table("revocations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_revocations_run_id"))

    op.drop_table("revocations")
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_credentials_volunteer_id"))

    op.drop_table("credentials")
    op.drop_table("volunteers")
    op.drop_table("signing_keys")
    op.drop_table("runs")
