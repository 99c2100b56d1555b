"""the organizers' dashboard: run time series, browser logins, invite codes, public checkpoints

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-12 09:00:00

New tables only; nothing existing changes. A run's invite code made with the run stays in
``runs.invite_code_hash``; codes made later live in ``invite_codes``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "series_points",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("t", sa.Float(), nullable=False),
        sa.Column("span", sa.Float(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("peers", sa.Float(), nullable=False),
        sa.Column("samples_per_second", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("metric", sa.Float(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column("checkpoint_epoch", sa.Integer(), nullable=True),
        sa.Column("samples_total", sa.Float(), nullable=False),
        sa.Column("samples_verified", sa.Float(), nullable=False),
        sa.Column("global_epoch", sa.Integer(), nullable=False),
        sa.Column("averaging_rounds", sa.Float(), nullable=False),
        sa.Column("bytes", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("series_points", schema=None) as batch_op:
        batch_op.create_index("ix_series_points_run_t", ["run_id", "t"], unique=False)

    op.create_table(
        "organizer_logins",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("credential_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.Column("address", sa.String(length=64), nullable=False),
        sa.Column("user_agent", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(["credential_id"], ["credentials.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("secret_hash"),
    )

    op.create_table(
        "invite_codes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("code_hash", sa.String(length=64), nullable=False),
        sa.Column("hint", sa.String(length=16), nullable=False),
        sa.Column("label", sa.String(length=100), nullable=False),
        sa.Column("max_uses", sa.Integer(), nullable=True),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_used_at", sa.Float(), nullable=True),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("code_hash"),
    )
    with op.batch_alter_table("invite_codes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_invite_codes_run_id"), ["run_id"], unique=False)

    op.create_table(
        "checkpoint_releases",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("published_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.PrimaryKeyConstraint("run_id", "epoch"),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_releases")
    with op.batch_alter_table("invite_codes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_invite_codes_run_id"))
    op.drop_table("invite_codes")
    op.drop_table("organizer_logins")
    with op.batch_alter_table("series_points", schema=None) as batch_op:
        batch_op.drop_index("ix_series_points_run_t")
    op.drop_table("series_points")
