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
        default=60.0, gt=0, description="Registrations per client address per minute."
    )
    burst: int = Field(
        default=10, ge=1, description="Requests a client may make at once before the rate applies."
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
    default_samples_per_second: float = Field(
        default=20.0,
        gt=0,
        description="Throughput assumed for a peer that reported none yet (sizes deadlines).",
    )


class CreditSettings(BaseModel):
    throughput_tolerance: float = Field(
        default=1.5,
        ge=1.0,
        description="Credits are capped at profiled throughput x this factor x elapsed time.",
    )
    unprofiled_max_samples_per_second: float = Field(
        default=5000.0, gt=0, description="Throughput cap for a peer whose profile carries no benchmark."
    )
    progress_record_window: float = Field(
        default=300.0,
        gt=0,
        description="A lease counts as verified if the swarm saw the peer's progress this recently.",
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
    poll_interval: float = Field(default=5.0, gt=0, description="Seconds between the swarm peer's DHT reads.")
    checkpoint_interval: float = Field(
        default=300.0,
        ge=0,
        description="Seconds between checkpoints of each run's model (0: no checkpoints).",
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
