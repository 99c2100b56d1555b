"""The agent's settings: one pydantic-settings model, environment prefix ``VOLUNTEER_``.

``volunteer-app join`` flags override the environment, which overrides the defaults. Where files live:
``config_dir`` holds the credential store (``credentials.json``, mode 0600), the peer keys
(``keys/``), the benchmark cache, the report outbox and the worker logs (``logs/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_config_dir() -> Path:
    """The per-user config directory (platformdirs): ``~/.config/volunteer-app`` on Linux, Application
    Support on macOS, the roaming AppData folder on Windows."""
    return Path(platformdirs.user_config_dir("volunteer-app", appauthor=False, roaming=True))


class AgentSettings(BaseSettings):
    """Settings of one volunteer agent."""

    model_config = SettingsConfigDict(env_prefix="VOLUNTEER_", extra="ignore")

    config_dir: Path = Field(
        default_factory=default_config_dir, description="Credential, keys, logs and caches."
    )
    coordinator: str | None = Field(
        default=None, description="Coordinator URL, e.g. https://train.example.org."
    )
    run: str | None = Field(default=None, description="Run to contribute to.")
    name: str | None = Field(default=None, description="Public name on the leaderboard (default: user-host).")
    invite_code: str | None = Field(default=None, description="Invite code for an invite-only run.")
    max_threads: int | None = Field(default=None, ge=1, description="Most CPU threads training may use.")
    max_memory_gb: float | None = Field(
        default=None, gt=0, description="Memory cap; the micro-batch shrinks to fit."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Train on the GPU when there is one."
    )
    listen_host: str = Field(default="0.0.0.0", description="Address the worker's swarm peer listens on.")
    announce_host: str | None = Field(
        default=None, description="Public address to announce (with port forwarding)."
    )
    accepts_connections: bool | None = Field(
        default=None,
        description="Whether other peers can dial this machine (False: client mode). None: unknown.",
    )
    reachability_recheck: float = Field(
        default=600.0,
        gt=0,
        description="Seconds at least between two checks of how other peers reach this computer: a worker cut "
        "off from the swarm's averaging joins again (the coordinator dials it back anew) at most this often.",
    )
    cache_max_gb: float = Field(
        default=10.0,
        gt=0,
        description="Most disk the files of runs (fetched from coordinators) may take in the cache.",
    )
    benchmark_seconds: float = Field(
        default=4.0, ge=0, description="Length of the task micro-benchmark (0 skips it)."
    )
    worker_restarts: int = Field(
        default=10, ge=0, description="Worker restarts allowed per hour before giving up."
    )
    status_interval: float = Field(
        default=5.0, gt=0, description="Seconds between status lines of `join --json`."
    )
    log_level: str = Field(
        default="WARNING", description="Log level of the worker (its log is in config_dir/logs)."
    )
    control_host: str = Field(
        default="127.0.0.1",
        description="Address of the agent's control API. Anything but loopback also needs --allow-remote.",
    )
    control_port: int = Field(default=0, ge=0, le=65535, description="Port of the control API (0: any free).")

    @property
    def credentials_path(self) -> Path:
        return self.config_dir / "credentials.json"

    @property
    def keys_dir(self) -> Path:
        return self.config_dir / "keys"

    @property
    def cache_dir(self) -> Path:
        """Files the agent fetched for runs, named by SHA-256 (mode 0700): the only files a worker opens
        because a coordinator asked."""
        return self.config_dir / "cache"

    @property
    def work_dir(self) -> Path:
        """The worker's and speed test's working directory: the agent's own, empty, so that nothing in the
        folder the volunteer started from can be imported by them."""
        return self.config_dir / "work"

    @property
    def logs_dir(self) -> Path:
        return self.config_dir / "logs"

    @property
    def agent_state_path(self) -> Path:
        """Where the running agent says where it is (pid, URL); mode 0600."""
        return self.config_dir / "agent.json"

    @property
    def agent_lock_path(self) -> Path:
        """Locked by the running agent: one agent per user (per config dir)."""
        return self.config_dir / "agent.lock"

    @property
    def control_token_path(self) -> Path:
        """The control API's token, created at the agent's first start; mode 0600."""
        return self.config_dir / "control-token"

    @property
    def policy_path(self) -> Path:
        """The volunteer's settings (``volunteer-app settings``)."""
        return self.config_dir / "settings.json"

    @property
    def memory_path(self) -> Path:
        """What the agent remembers across restarts: the run it contributes to, pause and snooze."""
        return self.config_dir / "agent-memory.json"

    @property
    def agent_log_path(self) -> Path:
        return self.logs_dir / "agent.log"
