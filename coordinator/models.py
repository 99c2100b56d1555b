"""The coordinator's tables (SQLAlchemy 2). Schema changes go through a migration in ``migrations/versions``.

Times are Unix seconds (floats) so that they compare directly with hivemind's DHT time and token expiry.
JSON columns hold pydantic-validated documents (task config, profile, assignment).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from volunteer_app.states import LeaseState, RunState, SessionState, ShardState, SpotCheckState, WorkerState


class Base(DeclarativeBase):
    pass


class SigningKeyRecord(Base):
    """A coordinator signing key (the private half lives in DATA_DIR/keys/<kid>.pem, mode 0600)."""

    __tablename__ = "signing_keys"
    kid: Mapped[str] = mapped_column(String(32), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[float] = mapped_column(Float)
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    retired_at: Mapped[float | None] = mapped_column(Float, nullable=True)


def volunteer_name_key(name: str) -> str:
    """How volunteer names are compared: ``Ada``, ``ada`` and ``ada.`` are one name (leaderboard impersonation)."""
    return name.strip().lower().rstrip("._-")


def _name_key_default(context: Any) -> str:
    return volunteer_name_key(context.get_current_parameters()["name"])


class Volunteer(Base):
    __tablename__ = "volunteers"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(40), unique=True)
    name_key: Mapped[str] = mapped_column(String(80), default=_name_key_default)
    """The name as it is compared (``coordinator.accounts.volunteers.name_key``): names with one key are one
    name."""
    created_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float | None] = mapped_column(Float, nullable=True)
    banned_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ban_reason: Mapped[str | None] = mapped_column(String(500), nullable=True)

    __table_args__ = (Index("uq_volunteers_name_key", "name_key", unique=True),)


class Credential(Base):
    """A volunteer or organizer credential, stored as the SHA-256 of the secret only."""

    __tablename__ = "credentials"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # "volunteer" | "organizer"
    volunteer_id: Mapped[str | None] = mapped_column(ForeignKey("volunteers.id"), nullable=True, index=True)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_used_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(40), unique=True)
    task: Mapped[str] = mapped_column(String(200))
    task_config: Mapped[dict] = mapped_column(JSON)
    optimizer: Mapped[dict] = mapped_column(JSON)
    description: Mapped[str] = mapped_column(Text, default="")
    visibility: Mapped[str] = mapped_column(String(16), default="open")
    invite_code_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    state: Mapped[str] = mapped_column(String(16), default=RunState.ACTIVE.value)  # a RunState
    data_epochs: Mapped[int] = mapped_column(Integer, default=1)
    current_data_epoch: Mapped[int] = mapped_column(Integer, default=0)
    num_shards: Mapped[int] = mapped_column(Integer)
    samples_per_shard: Mapped[int] = mapped_column(Integer)
    hivemind_run_id: Mapped[str] = mapped_column(String(80))
    swarm_port: Mapped[int] = mapped_column(Integer, default=0)
    swarm_maddrs: Mapped[list] = mapped_column(JSON, default=list)
    swarm_updated_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class RunMember(Base):
    """A volunteer admitted to an invite-only run (by invite code)."""

    __tablename__ = "run_members"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"), primary_key=True)
    joined_at: Mapped[float] = mapped_column(Float)


class PeerSession(Base):
    """One worker's membership in a run: from join to leave (or loss, or a ban)."""

    __tablename__ = "peer_sessions"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"), index=True)
    credential_id: Mapped[str] = mapped_column(ForeignKey("credentials.id"))
    peer_public_key: Mapped[str] = mapped_column(Text)
    agent_version: Mapped[str] = mapped_column(String(40))
    profile: Mapped[dict] = mapped_column(JSON)
    """The compact part of the peer's hardware profile (``coordinator.retention.stored_profile``)."""
    assignment: Mapped[dict] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default=SessionState.ACTIVE.value)  # a SessionState
    worker_state: Mapped[str] = mapped_column(String(16), default=WorkerState.STARTING.value)  # a WorkerState
    paused_by_coordinator: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)
    last_heartbeat_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    token_expires_at: Mapped[float] = mapped_column(Float)
    token_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """SHA-256 of the session's current peer token: only that token may be traded for a new one."""
    epoch_at_join: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The swarm's epoch (as its progress records show it) when this session joined."""
    max_samples_per_second: Mapped[float] = mapped_column(Float)
    samples_total: Mapped[int] = mapped_column(BigInteger, default=0)
    samples_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    local_epoch: Mapped[int] = mapped_column(Integer, default=0)
    global_epoch: Mapped[int] = mapped_column(Integer, default=0)
    swarm_size: Mapped[int] = mapped_column(Integer, default=0)
    averaging_rounds: Mapped[int] = mapped_column(Integer, default=0)
    bytes_sent: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_received: Mapped[int] = mapped_column(BigInteger, default=0)
    flagged_heartbeats: Mapped[int] = mapped_column(Integer, default=0)
    dht_seen_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    dht_samples_per_second: Mapped[float | None] = mapped_column(Float, nullable=True)
    dht_epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (Index("ix_peer_sessions_run_state", "run_id", "state"),)


class PrunedTotals(Base):
    """What a run's deleted sessions had added to its totals (``coordinator.retention``).

    The sweeper deletes ended sessions that nothing must keep (no credit, spot check, revocation or live
    lease), with their returned and expired leases, so that re-joins cannot grow the store without end.
    Their reported figures and lease counts are added here first, so that the run's statistics, its time
    series and the ``/metrics`` counters never go down."""

    __tablename__ = "pruned_totals"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    sessions: Mapped[int] = mapped_column(Integer, default=0)
    leases_returned: Mapped[int] = mapped_column(Integer, default=0)
    leases_expired: Mapped[int] = mapped_column(Integer, default=0)
    # Floats, like the sums they join: hostile peers may report up to 2**53 each, and SQL integers overflow.
    samples_total: Mapped[float] = mapped_column(Float, default=0.0)
    averaging_rounds: Mapped[float] = mapped_column(Float, default=0.0)
    bytes: Mapped[float] = mapped_column(Float, default=0.0)
    global_epoch: Mapped[int] = mapped_column(Integer, default=0)


class Shard(Base):
    """One shard of one data epoch of a run and where it stands."""

    __tablename__ = "shards"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    data_epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default=ShardState.PENDING.value)  # a ShardState
    lease_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    done_at: Mapped[float | None] = mapped_column(Float, nullable=True)

    __table_args__ = (Index("ix_shards_run_epoch_state", "run_id", "data_epoch", "state"),)


class Lease(Base):
    __tablename__ = "leases"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("peer_sessions.id"), index=True)
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"))
    data_epoch: Mapped[int] = mapped_column(Integer)
    shard: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(BigInteger)
    samples: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=LeaseState.ACTIVE.value)  # a LeaseState
    issued_at: Mapped[float] = mapped_column(Float)
    deadline: Mapped[float] = mapped_column(Float)
    not_before: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Earliest completion the device-class ceiling allows (the lease's minimum duration)."""
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_claimed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    samples_credited: Mapped[int | None] = mapped_column(Integer, nullable=True)
    compute_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    flagged: Mapped[bool] = mapped_column(Boolean, default=False)
    flag_reason: Mapped[str | None] = mapped_column(String(500), nullable=True)

    __table_args__ = (Index("ix_leases_run_state_deadline", "run_id", "state", "deadline"),)


class LedgerEntry(Base):
    """One credit. A lease is credited at most once (unique lease_id)."""

    __tablename__ = "ledger_entries"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("peer_sessions.id"), index=True)
    lease_id: Mapped[str | None] = mapped_column(ForeignKey("leases.id"), nullable=True)
    samples: Mapped[int] = mapped_column(BigInteger)
    samples_claimed: Mapped[int] = mapped_column(BigInteger)
    compute_seconds: Mapped[float] = mapped_column(Float)
    verified: Mapped[bool] = mapped_column(Boolean, default=False)
    flagged: Mapped[bool] = mapped_column(Boolean, default=False)
    reason: Mapped[str | None] = mapped_column(String(500), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (UniqueConstraint("lease_id", name="uq_ledger_entries_lease_id"),)


class PeerKey(Base):
    """A worker's hivemind public key belongs to the first volunteer who joined with it, in every run.

    Progress records in the swarm are matched to sessions by key, so a key used by another volunteer
    would hand that volunteer someone else's work; a banned volunteer's keys stay banned."""

    __tablename__ = "peer_keys"
    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)  # SHA-256 of the OpenSSH key
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"), index=True)
    first_used_at: Mapped[float] = mapped_column(Float)


class SpotCheck(Base):
    """A proof-of-training spot check of one completed lease: the run's swarm peer recomputes the loss
    of the peer's shard micro-batches on the shared model and compares it with what the peer reported."""

    __tablename__ = "spot_checks"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id"), unique=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("peer_sessions.id"), index=True)
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"), index=True)
    data_epoch: Mapped[int] = mapped_column(Integer)
    shard: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(BigInteger)
    samples: Mapped[int] = mapped_column(Integer)
    micro_batch_size: Mapped[int] = mapped_column(Integer)
    reported_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    model_epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    state: Mapped[str] = mapped_column(String(16), default=SpotCheckState.PENDING.value)  # a SpotCheckState
    created_at: Mapped[float] = mapped_column(Float)
    claimed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    decided_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    recomputed_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    detail: Mapped[str | None] = mapped_column(String(500), nullable=True)

    __table_args__ = (Index("ix_spot_checks_run_state", "run_id", "state"),)


class Flag(Base):
    """Something a volunteer claimed that the coordinator capped or refused, for the organizers to see.

    Repeats of one kind from one session within a minute bump ``count`` instead of adding rows, so that a
    peer that misreports on every heartbeat cannot flood the table."""

    __tablename__ = "flags"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"), index=True)
    session_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    lease_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    kind: Mapped[str] = mapped_column(String(40))
    detail: Mapped[str] = mapped_column(String(500))
    count: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[float] = mapped_column(Float)
    last_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index("ix_flags_session_kind", "session_id", "kind"),)


class Revocation(Base):
    """A revoked peer session (a ban): its peer tokens are refused until they would have expired anyway."""

    __tablename__ = "revocations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    volunteer_id: Mapped[str] = mapped_column(ForeignKey("volunteers.id"))
    session_id: Mapped[str] = mapped_column(String(32), unique=True)
    reason: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)


class SeriesPoint(Base):
    """One point of a run's time series (``coordinator.monitoring.series``): what the dashboard charts.

    Raw points are recorded every ``series.interval`` seconds while the run changes; as they age they are
    merged into coarser points (``span`` seconds each, ``n`` raw points) so that a month-long run keeps a
    few thousand rows. Rates and the loss are means over the span; cumulative figures are the span's last."""

    __tablename__ = "series_points"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    t: Mapped[float] = mapped_column(Float)
    span: Mapped[float] = mapped_column(Float, default=0.0)
    n: Mapped[int] = mapped_column(Integer, default=1)
    peers: Mapped[float] = mapped_column(Float, default=0.0)
    samples_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    metric: Mapped[float | None] = mapped_column(Float, nullable=True)
    """The task's held-out headline metric, from the checkpoint saved since the previous point."""
    eval_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    checkpoint_epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    samples_total: Mapped[float] = mapped_column(Float, default=0.0)
    samples_verified: Mapped[float] = mapped_column(Float, default=0.0)
    global_epoch: Mapped[int] = mapped_column(Integer, default=0)
    averaging_rounds: Mapped[float] = mapped_column(Float, default=0.0)
    bytes: Mapped[float] = mapped_column(Float, default=0.0)

    __table_args__ = (Index("ix_series_points_run_t", "run_id", "t"),)


class OrganizerLogin(Base):
    """A browser signed in to the dashboard with the organizer token (``coordinator.accounts.logins``).

    The browser holds a random secret in an HttpOnly cookie; only its SHA-256 is stored. A login belongs to
    the organizer credential it was made with, so rotating the organizer token signs every browser out."""

    __tablename__ = "organizer_logins"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    credential_id: Mapped[str] = mapped_column(ForeignKey("credentials.id"))
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    address: Mapped[str] = mapped_column(String(64), default="")
    user_agent: Mapped[str] = mapped_column(String(200), default="")


class InviteCode(Base):
    """An invite code of a run (``coordinator.accounts.invites``): registering or joining with it admits a
    volunteer to the invite-only run. Stored as a hash; ``hint`` (its first characters) tells codes apart."""

    __tablename__ = "invite_codes"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    code_hash: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(String(16))
    label: Mapped[str] = mapped_column(String(100), default="")
    max_uses: Mapped[int | None] = mapped_column(Integer, nullable=True)
    uses: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    last_used_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class CheckpointRelease(Base):
    """A checkpoint the organizers made public: anyone may download it from the gallery."""

    __tablename__ = "checkpoint_releases"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    published_at: Mapped[float] = mapped_column(Float)
