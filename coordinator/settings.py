"""The coordinator's settings: one pydantic-settings model with nested sections.

Every field can be set by environment variable with the ``VOLUNTEER_COORDINATOR_`` prefix and ``__``
between sections, e.g. ``VOLUNTEER_COORDINATOR_TOKENS__PEER_TOKEN_TTL=1800``. The CLI's flags override
the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class TokenSettings(BaseModel):
    peer_token_ttl: float = Field(
        default=3600.0, gt=10, description="Seconds a peer token is valid (default 1 h)."
    )
    refresh_fraction: float = Field(
        default=0.8,
        gt=0.1,
        lt=1.0,
        description="Heartbeats carry a new token once this fraction of its lifetime has passed (default 80 %).",
    )
    refresh_grace: float = Field(
        default=300.0,
        ge=0,
        description="Seconds after expiry during which a token may still be traded for a new one.",
    )


class LimitSettings(BaseModel):
    max_body_bytes: int = Field(
        default=64 * 1024, ge=1024, description="Largest request body accepted (413 above)."
    )
    join_per_minute: float = Field(default=12.0, gt=0, description="Joins allowed per credential per minute.")
    heartbeat_per_minute: float = Field(
        default=120.0, gt=0, description="Heartbeats per credential per minute."
    )
    register_per_minute: float = Field(
        default=6.0, gt=0, description="Registrations per client address (IPv6: per /64) per minute."
    )
    register_per_day: float = Field(
        default=100.0,
        gt=0,
        description="Registrations per client address (IPv6: per /64) per day, on top of the per-minute "
        "rate (a bucket of this size refilled over 24 h): one address cannot mint volunteers, and the rows "
        "that come with them, without end. A volunteer registers once per machine, so a classroom or a "
        "small hackathon behind one NAT fits; raise it for a larger event behind one address.",
    )
    join_per_day: float = Field(
        default=500.0,
        gt=0,
        description="Joins per volunteer per day, on top of ``join_per_minute`` (a bucket of this size "
        "refilled over 24 h). An agent joins when it starts and when its session ends, a few times a day; "
        "this bounds the sessions (and their leases) one credential can add to the store in a day.",
    )
    invite_guesses: int = Field(
        default=10,
        ge=1,
        description="Wrong invite codes one client address (IPv6: per /64) may present per "
        "``invite_guess_window``, over all its credentials, runs and registrations. Once spent, every code "
        "from that address, the right one too, is refused with 429 until the window ends. A volunteer who "
        "mistypes a code a few times never meets it; an attacker gets 240 guesses a day per address.",
    )
    invite_guess_window: float = Field(
        default=3600.0,
        gt=0,
        description="Seconds of the invite-code guess window; it starts at an address's first guess.",
    )
    refresh_per_minute: float = Field(
        default=6.0, gt=0, description="Peer-token refreshes per credential per minute (agents need ~1/h)."
    )
    lease_per_minute: float = Field(
        default=600.0,
        gt=0,
        description="Lease takes, and separately lease completions, per credential per minute. A flood "
        "guard only: how fast a lease may be completed is bounded by its minimum duration.",
    )
    read_per_minute: float = Field(
        default=600.0, gt=0, description="Public reads (runs, leaderboards) per client address per minute."
    )
    live_per_minute: float = Field(
        default=60.0,
        gt=0,
        description="Live-feed websocket connections opened per client address per minute.",
    )
    live_connections_per_address: int = Field(
        default=32, ge=1, description="Live-feed websockets one client address may hold open at once."
    )
    live_message_bytes: int = Field(
        default=1024, ge=16, description="Largest message a live-feed client may send (it only sends 'ping')."
    )
    burst: int = Field(
        default=10, ge=1, description="Requests a client may make at once before the rate applies."
    )
    login_per_minute: float = Field(
        default=6.0,
        gt=0,
        description="Dashboard sign-in attempts per client address per minute (after a burst of 5): the "
        "organizer token cannot be guessed, and nobody gets to try.",
    )
    download_per_minute: float = Field(
        default=6.0,
        gt=0,
        description="Checkpoint downloads per client address per minute (after a burst of 3).",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses of reverse proxies whose X-Forwarded-For header names the client. Empty (the "
        "default): the header is ignored, so per-address limits cannot be dodged by forging it.",
    )


class WorkSettings(BaseModel):
    heartbeat_interval: float = Field(
        default=10.0, gt=0, description="Seconds between an agent's heartbeats."
    )
    session_timeout: float = Field(
        default=90.0, gt=0, description="A session without heartbeats for this long is marked lost."
    )
    lease_min_seconds: float = Field(default=60.0, gt=0, description="Shortest lease deadline.")
    lease_max_seconds: float = Field(default=6 * 3600.0, gt=0, description="Longest lease deadline.")
    lease_safety_factor: float = Field(
        default=3.0,
        ge=1.0,
        description="Deadline = shard samples / peer throughput x this factor (+ lease_min).",
    )
    max_leases_per_session: int = Field(
        default=2, ge=1, description="Leases one session may hold (one prefetched)."
    )
    max_sessions_per_volunteer: int = Field(
        default=8, ge=1, description="Active sessions (workers) one volunteer may have in one run."
    )
    ended_session_retention: float = Field(
        default=24 * 3600.0,
        ge=0,
        description="Seconds an ended session (left, replaced, stopped, or lost and silent) stays in the "
        "store before the sweeper deletes it, if nothing that must be kept refers to it (credit, spot "
        "checks, revocations, a live lease) and the volunteer has a live or newer session in that run. "
        "What it reported is added to its run's totals first, so no figure changes. A volunteer's re-join "
        "deletes its older ended sessions in that run at once, on the same terms (default 1 day).",
    )
    max_unverified_claims: int = Field(
        default=2,
        ge=1,
        description="Completed shards awaiting the swarm's confirmation one session may hold before it gets "
        "more work: a peer the swarm never sees cannot sit on the queue (honest peers are confirmed at once).",
    )
    default_samples_per_second: float = Field(
        default=20.0,
        gt=0,
        description="Throughput assumed for a peer that reported none yet (sizes deadlines).",
    )


class CreditSettings(BaseModel):
    """How claims become credit (docs/credit-and-trust.md). Nothing a peer says about itself raises a cap:
    its benchmark can only lower the ceiling of its device class."""

    throughput_tolerance: float = Field(
        default=1.5,
        ge=1.0,
        description="A peer's benchmark x this factor may lower its device-class ceiling (never raise it).",
    )
    cpu_thread_max_samples_per_second: float = Field(
        default=1000.0,
        gt=0,
        description="Plausible ceiling per assigned CPU thread, about 10x the fastest built-in preset on one "
        "core here (shapes-dalle tiny 112, tiny-lm tiny 69): a lease cannot be completed faster than this.",
    )
    gpu_max_samples_per_second: float = Field(
        default=50000.0, gt=0, description="Plausible ceiling per GPU of the profile."
    )
    max_credited_cpu_threads: int = Field(
        default=64, ge=1, description="CPU threads counted toward the ceiling, whatever the profile claims."
    )
    max_credited_gpus: int = Field(
        default=8, ge=1, description="GPUs counted toward the ceiling, whatever the profile claims."
    )
    unprofiled_max_samples_per_second: float = Field(
        default=5000.0,
        gt=0,
        description="Kept for old settings files: a peer without a benchmark gets its device-class ceiling.",
    )
    progress_record_window: float = Field(
        default=300.0,
        gt=0,
        description="Seconds after a lease's completion during which the swarm's progress records may still "
        "verify it; a shard whose claim stays unverified this long goes back to the queue.",
    )
    epoch_lag_tolerance: int = Field(
        default=2,
        ge=0,
        description="A peer whose progress records trail the swarm's epoch (the median over volunteers) by "
        "more than this took no part in its averaging rounds: its claims stay unverified.",
    )
    isolation_epochs: int = Field(
        default=5,
        ge=1,
        description="A peer in a swarm of two or more that has averaged with nobody while the swarm's epoch "
        "moved this many epochs past the one it joined at is cut off (behind NAT as a client, say): its "
        "work has not reached the shared model, so its claims stay unverified and the peers table flags it.",
    )
    spot_check_fraction: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Share of verified lease completions picked (unpredictably) for a proof-of-training check.",
    )
    flagged_spot_check_fraction: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="Share picked from a volunteer who already failed a spot check.",
    )
    spot_check_timeout: float = Field(
        default=3600.0,
        gt=0,
        description="A check nobody decided within this many seconds expires and its credit is settled "
        "(no checker ran); a claimed check not decided within a tenth of it is offered again.",
    )


class SwarmSettings(BaseModel):
    enabled: bool = Field(default=True, description="Run a bootstrap hivemind peer per active run.")
    host: str | None = Field(
        default=None, description="Address the swarm peers listen on (default: the HTTP host)."
    )
    announce_host: str | None = Field(
        default=None, description="Public address to announce to volunteers when the server is behind NAT."
    )
    port_base: int = Field(
        default=0,
        ge=0,
        le=65000,
        description="First TCP port for swarm peers (run i uses base+i); 0 picks free ports.",
    )
    relay: bool = Field(
        default=True,
        description="Each run's swarm peer relays for volunteers nobody can dial (behind NAT): their "
        "averaging traffic passes through this server (libp2p circuit relay v2).",
    )
    poll_interval: float = Field(default=5.0, gt=0, description="Seconds between the swarm peer's DHT reads.")
    checkpoint_interval: float = Field(
        default=300.0,
        ge=0,
        description="Seconds between checkpoints of each run's model (0: no checkpoints).",
    )


class DashboardSettings(BaseModel):
    """The organizers' browser sign-in (``coordinator.accounts.logins``)."""

    session_ttl: float = Field(
        default=12 * 3600.0, gt=60, description="Seconds a dashboard sign-in lasts at most (default 12 h)."
    )
    session_idle_timeout: float = Field(
        default=2 * 3600.0,
        gt=60,
        description="A sign-in unused for this many seconds ends (default 2 h).",
    )


class SeriesSettings(BaseModel):
    """Each run's time series (``coordinator.monitoring.series``): what the dashboard's charts draw."""

    interval: float = Field(
        default=10.0, gt=0, description="Seconds between points while a run changes (default 10)."
    )
    compact_every: float = Field(
        default=300.0, gt=0, description="Seconds between merges of aged points into coarser ones."
    )


class CoordinatorSettings(BaseSettings):
    """Settings of one coordinator (``volunteer-coordinator serve``)."""

    model_config = SettingsConfigDict(
        env_prefix="VOLUNTEER_COORDINATOR_", env_nested_delimiter="__", extra="ignore"
    )

    data_dir: Path = Field(
        default=Path("coordinator-data"), description="Store, signing keys, admin token, swarm identities."
    )
    database_url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy URL; default sqlite:///DATA_DIR/coordinator.db (PostgreSQL: postgresql+psycopg://...).",
    )
    host: str = Field(default="127.0.0.1", description="HTTP listen address.")
    port: int = Field(
        default=8470, ge=0, le=65535, description="HTTP port; 0 picks a free one and prints the URL."
    )
    worker_threads: int = Field(
        default=8, ge=1, le=256, description="Threads that run request handlers (database work)."
    )
    live_interval: float = Field(
        default=1.0, gt=0, description="Seconds between live-feed pushes of changed runs."
    )
    tokens: TokenSettings = Field(default_factory=TokenSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    work: WorkSettings = Field(default_factory=WorkSettings)
    credit: CreditSettings = Field(default_factory=CreditSettings)
    swarm: SwarmSettings = Field(default_factory=SwarmSettings)
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    series: SeriesSettings = Field(default_factory=SeriesSettings)

    @property
    def resolved_database_url(self) -> str:
        if self.database_url is not None:
            return self.database_url.get_secret_value()
        return f"sqlite:///{(self.data_dir / 'coordinator.db').resolve()}"

    @property
    def keys_dir(self) -> Path:
        return self.data_dir / "keys"

    @property
    def admin_token_path(self) -> Path:
        return self.data_dir / "admin-token"

    @property
    def swarm_dir(self) -> Path:
        return self.data_dir / "swarm"
