"""Keeps one swarm-peer process (``python -m coordinator.swarm``, :mod:`coordinator.swarm.peer`) per active or
paused run while ``serve`` runs.

New runs get a peer within ``poll_interval`` seconds, finished runs lose theirs, and a peer that dies
is restarted with exponential backoff (1 s doubling to 60 s) so a crash loop cannot eat the server.

It runs in the web process, which never imports torch: it only starts, watches and stops the peers, with the
command line their ``main`` parses, which is why it lives beside them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from sqlalchemy import select

from coordinator.models import Run
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from volunteer_app.states import RunState

logger = logging.getLogger("coordinator.swarm")


@dataclass
class _Peer:
    process: subprocess.Popen[bytes] | None = None
    failures: int = 0
    next_start: float = 0.0
    started_at: float = field(default_factory=time.monotonic)


class SwarmManager:
    def __init__(self, *, settings: CoordinatorSettings, store: Store):
        self.settings = settings
        self.store = store
        self.peers: dict[str, _Peer] = {}

    def _wanted(self) -> dict[str, int]:
        with self.store.read() as db:
            return {
                run.name: run.swarm_port
                for run in db.scalars(select(Run).where(Run.state != RunState.FINISHED))
            }

    def _start(self, name: str, port: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["VOLUNTEER_COORDINATOR_DATABASE_URL"] = self.settings.resolved_database_url
        env["VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL"] = str(self.settings.swarm.poll_interval)
        env["VOLUNTEER_COORDINATOR_SWARM__CHECKPOINT_INTERVAL"] = str(self.settings.swarm.checkpoint_interval)
        if self.settings.swarm.announce_host:
            env["VOLUNTEER_COORDINATOR_SWARM__ANNOUNCE_HOST"] = self.settings.swarm.announce_host
        env["VOLUNTEER_COORDINATOR_TOKENS__PEER_TOKEN_TTL"] = str(self.settings.tokens.peer_token_ttl)
        env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
        host = self.settings.swarm.host or self.settings.host
        if host in ("localhost", ""):
            host = "127.0.0.1"
        log_path = self.settings.swarm_dir / f"{name}.log"
        self.settings.swarm_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            command = [
                sys.executable,
                "-m",
                "coordinator.swarm",
                "--data-dir",
                str(self.settings.data_dir),
                "--run",
                name,
                "--host",
                host,
                "--port",
                str(port),
            ]
            process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        logger.info("started swarm peer for run %s (pid %d, log %s)", name, process.pid, log_path)
        return process

    def sync(self) -> None:
        wanted = self._wanted()
        now = time.monotonic()
        for name in list(self.peers):
            if name not in wanted:
                self._stop(self.peers.pop(name), name)
        for name, port in wanted.items():
            peer = self.peers.setdefault(name, _Peer())
            if peer.process is not None and peer.process.poll() is None:
                if now - peer.started_at > 60:
                    peer.failures = 0
                continue
            if peer.process is not None:
                code = peer.process.returncode
                peer.process = None
                peer.failures += 1
                peer.next_start = now + min(60.0, 2.0 ** (peer.failures - 1))
                logger.warning(
                    "swarm peer for run %s exited with code %s; restarting in %.0f s (see %s)",
                    name,
                    code,
                    peer.next_start - now,
                    self.settings.swarm_dir / f"{name}.log",
                )
            if now >= peer.next_start:
                peer.process = self._start(name, port)
                peer.started_at = now

    def forget_addresses(self) -> None:
        """Clear the addresses that the previous ``serve``'s swarm peers published: those peers are gone,
        and a volunteer sent to them would find nobody. Each new peer publishes its own within seconds."""
        with self.store.write() as db:
            for run in db.scalars(select(Run)):
                if run.swarm_maddrs:
                    run.swarm_maddrs = []

    async def run_forever(self) -> None:
        try:
            await asyncio.to_thread(self.forget_addresses)
        except Exception:
            logger.exception("could not clear the previous swarm addresses")
        while True:
            try:
                await asyncio.to_thread(self.sync)
            except Exception:
                logger.exception("swarm manager failed to sync; retrying")
            await asyncio.sleep(min(3.0, self.settings.swarm.poll_interval))

    @staticmethod
    def _stop(peer: _Peer, name: str) -> None:
        process = peer.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            logger.warning("swarm peer for run %s did not stop; killing it", name)
            process.kill()
            process.wait(timeout=5)

    def stop_all(self) -> None:
        for name, peer in list(self.peers.items()):
            self._stop(peer, name)
        self.peers.clear()
