"""The coordinator's swarm peer for one run: ``python -m coordinator.swarm --data-dir DIR --run NAME``.

Started by ``volunteer-coordinator serve`` (see :mod:`coordinator.swarm.manager`), one process per active
run. It is the run's bootstrap DHT peer (stable identity in ``DATA_DIR/swarm/``), it uses the same token
check as every worker, and every ``poll_interval`` it:

* writes its reachable multiaddrs into the store (the join answer's ``initial_peers``),
* reads the peers' signed progress records (hivemind's ``<run>_progress`` key) so that the ledger can
  cross-check what sessions claim against what the swarm saw,
* publishes signed revocation records for banned sessions and refuses them itself,
* and, every ``checkpoint_interval``, saves the swarm's current model, evaluated
  (:mod:`coordinator.swarm.checkpointer`), which it also serves to volunteers who join when nobody else is
  training.

It also answers the gallery's ``generate`` requests (:class:`~coordinator.swarm.generate.GenerateServer`):
the web process, which never imports torch, forwards a caption over a loopback socket whose port and secret
are in ``DATA_DIR/swarm/<run>.generate.json`` (mode 0600); this process draws it with the latest checkpoint.

It runs the run's proof-of-training spot checks (:class:`~coordinator.swarm.spotchecker.SpotChecker`, in a
thread of its own): it claims the leases ``coordinator.credit.spotchecks`` sampled, recomputes the loss of
each peer's shard on the shared model and records the verdict.

It never trains and never joins an averaging round: the coordinator stays a bookkeeper, not a parameter
server; the checkpoint is a copy of what the volunteers agreed on.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from coordinator.accounts.authority import TokenAuthority
from coordinator.accounts.volunteers import revoked_sessions
from coordinator.checkpoints import (
    DEFAULT_KEEP,
    CheckpointStore,
    checkpoint_directory,
    generate_endpoint_file,
)
from coordinator.models import PeerSession, Run
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from coordinator.swarm.generate import GenerateServer
from coordinator.swarm.spotchecker import MIN_CHECK_INTERVAL, SpotChecker
from volunteer_app.protocol import OptimizerSettings
from volunteer_app.states import RunState, SessionState

logger = logging.getLogger("coordinator.swarm")

OWNER_PREFIX = b"[owner:"
# A heartbeat's throughput may exceed the peer's own DHT progress record by this factor plus slack
# (hivemind's figure is a smoothed estimate that lags and dips during averaging) before it counts as a mismatch.
_MISMATCH_FACTOR = 4.0
# How often the peer re-reads its own addresses and tells the store it is alive (seconds).
_MADDRS_REFRESH = 60.0
_MISMATCH_SLACK = 20.0


def progress_key(hivemind_run_id: str) -> str:
    return f"{hivemind_run_id}_progress"


def revocations_key(hivemind_run_id: str) -> str:
    return f"{hivemind_run_id}_revoked"


def owner_public_key(subkey: Any) -> bytes | None:
    """The RSA public key in a hivemind ``BytesWithPublicKey`` subkey (``b"[owner:ssh-rsa …]"``)."""
    if isinstance(subkey, bytes) and subkey.startswith(OWNER_PREFIX) and subkey.endswith(b"]"):
        return subkey[len(OWNER_PREFIX) : -1]
    return None


def replace_host(maddr: str, host: str) -> str:
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
        parts[1] = "ip6" if ":" in host else ("ip4" if host.replace(".", "").isdigit() else "dns")
        parts[2] = host
    return "/".join(parts)


class SwarmPeer:
    def __init__(self, *, settings: CoordinatorSettings, store: Store, run_name: str, host: str, port: int):
        import hivemind
        from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
        from hivemind.optim.progress_tracker import TrainingProgressSchema

        from volunteer_app.tokens import PeerToken, issue_peer_token
        from workers import compat
        from workers.authorizer import PeerTokenAuthorizer
        from workers.identity import load_hivemind_key

        self.settings = settings
        self.store = store
        self.authority = TokenAuthority(settings=settings, store=store)
        with store.read() as db:
            run = db.scalars(select(Run).where(Run.name == run_name)).first()
            if run is None:
                raise SystemExit(f"error: no run named {run_name!r}")
            self.run_id, self.run_name, self.hivemind_run_id = run.id, run.name, run.hivemind_run_id
            task, task_config = run.task, dict(run.task_config)
            optimizer_settings = OptimizerSettings.model_validate(run.optimizer)
        settings.swarm_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_path = settings.swarm_dir / f"{self.run_id}.rsa"
        rsa_key = load_hivemind_key(key_path)
        public_key = rsa_key.get_public_key().to_bytes()
        signing_key = self.authority.signing_key
        ttl = settings.tokens.peer_token_ttl
        session = f"swarm-{self.run_id[:8]}"

        def make_token() -> PeerToken:
            return issue_peer_token(
                signing_key,
                run=self.run_name,
                volunteer="coordinator",
                session=session,
                peer_public_key=public_key,
                ttl=ttl,
            )

        self.signing_key = signing_key
        self.authorizer = PeerTokenAuthorizer(
            run=self.run_name,
            coordinator_keys=self.authority.verifying_keys,
            peer_token=make_token(),
            local_private_key=rsa_key,
            token_factory=make_token,
            refresh_before=ttl * 0.2,
        )
        identity = settings.swarm_dir / f"{self.run_id}.p2p-identity"
        self.dht = hivemind.DHT(
            start=True,
            host_maddrs=[f"/ip4/{host}/tcp/{port}" if ":" not in host else f"/ip6/{host}/tcp/{port}"],
            identity_path=str(identity),
            authorizer=self.authorizer,
            record_validators=[
                SchemaValidator(TrainingProgressSchema, prefix=self.hivemind_run_id),
                RSASignatureValidator(rsa_key),
            ],
            # On a server the peer is dialled directly; it relays for volunteers nobody can dial (a relay
            # serves only while it believes itself public, which it is), and probes no NAT.
            **(
                compat.relay_service_options()
                if settings.swarm.relay
                else {"use_relay": False, "auto_nat": False, "nat_port_map": False}
            ),
        )
        self.checkpointer = None
        self.state: Any = None  # the shared model, for checkpoints and spot checks (a Checkpointer)
        self.state_lock = threading.Lock()
        directory = checkpoint_directory(settings.data_dir, self.run_name)
        keep = int(getattr(settings.swarm, "checkpoint_keep", DEFAULT_KEEP))
        spot_checks = (
            settings.credit.spot_check_fraction > 0 or settings.credit.flagged_spot_check_fraction > 0
        )
        if settings.swarm.checkpoint_interval > 0 or spot_checks:
            from coordinator.swarm.checkpointer import Checkpointer

            self.state = Checkpointer(
                dht=self.dht,
                hivemind_run_id=self.hivemind_run_id,
                run=self.run_name,
                task=task,
                task_config=task_config,
                directory=directory,
                interval=settings.swarm.checkpoint_interval,
                matchmaking_time=optimizer_settings.matchmaking_time,
                samples_per_epoch=optimizer_settings.samples_at_epoch,
                keep=keep,
            )
            if settings.swarm.checkpoint_interval > 0:
                self.checkpointer = self.state
        self.spot_checker: SpotChecker | None = None
        if spot_checks and self.state is not None:
            self.spot_checker = SpotChecker(
                store=store,
                settings=settings,
                run_id=self.run_id,
                state=self.state,
                state_lock=self.state_lock,
                interval=max(MIN_CHECK_INTERVAL, settings.swarm.poll_interval),
            )
            self.spot_checker.start()
        self.generator = GenerateServer(
            store=CheckpointStore(directory, keep=keep),
            endpoint_file=generate_endpoint_file(settings.data_dir, self.run_name),
        )
        self.published: set[str] = set()
        self._revoked: set[str] = set()
        self._maddrs: list[str] = []
        self._maddrs_checked = 0.0

    def visible_maddrs(self) -> list[str]:
        maddrs = [str(m) for m in self.dht.get_visible_maddrs(latest=True)]
        announce = self.settings.swarm.announce_host
        if announce:
            maddrs = sorted({replace_host(m, announce) for m in maddrs})
        return maddrs

    def poll_once(self) -> bool:
        """One round of bookkeeping. Returns False when the run has finished and the peer should exit."""
        from volunteer_app.tokens import sign_revocation
        from workers.authorizer import push_revocations

        now = time.time()
        if now - self._maddrs_checked > _MADDRS_REFRESH:
            self._maddrs, self._maddrs_checked = self.visible_maddrs(), now
        with self.store.read() as db:
            run = db.get(Run, self.run_id)
            if run is None or run.state == RunState.FINISHED:
                return False
            stale = run.swarm_maddrs != self._maddrs or (run.swarm_updated_at or 0) < now - _MADDRS_REFRESH
            revocations = [
                (r.session_id, r.expires_at) for r in revoked_sessions(db, run_id=self.run_id, now=now)
            ]
        if stale:  # the store only hears from us when something changed, or once a minute as a sign of life
            with self.store.write() as db:
                run = db.get(Run, self.run_id)
                if run is not None:
                    run.swarm_maddrs = self._maddrs
                    run.swarm_updated_at = now
        revoked = {s for s, _ in revocations}
        if revoked != self._revoked:
            push_revocations(self.dht, revoked)
            self._revoked = revoked
        for session_id, expires_at in revocations:
            if session_id in self.published:
                continue
            record = sign_revocation(
                self.signing_key, run=self.run_name, session=session_id, expires_at=expires_at
            )
            if self.dht.store(
                revocations_key(self.hivemind_run_id), record, expiration_time=expires_at, subkey=session_id
            ):
                self.published.add(session_id)
        self.read_progress(now)
        # a spot check holding the shared model (a few micro-batches, or a download) delays the checkpoint
        # to a later poll rather than this poll's bookkeeping
        if self.checkpointer is not None and self.state_lock.acquire(blocking=False):
            try:
                self.checkpointer.maybe_save()
            finally:
                self.state_lock.release()
        return True

    def read_progress(self, now: float) -> int:
        """Copy the peers' signed progress records onto their sessions. Returns how many matched."""
        # Peers store their progress on the nodes nearest to the key, which in a small swarm includes this
        # one: a local read answers without signing RPCs to every worker (latest=True would ask them all).
        found = self.dht.get(progress_key(self.hivemind_run_id), latest=False)
        if found is None or not isinstance(found.value, dict):
            return 0
        by_key: dict[bytes, dict[str, Any]] = {}
        for subkey, item in found.value.items():
            key = owner_public_key(subkey)
            value = getattr(item, "value", None)
            if key is None or not isinstance(value, dict):
                continue
            by_key[key.strip()] = value
        if not by_key:
            return 0
        matched = 0
        with self.store.write() as db:
            sessions = db.scalars(
                select(PeerSession).where(
                    PeerSession.run_id == self.run_id,
                    PeerSession.state.in_((SessionState.ACTIVE, SessionState.LOST)),
                )
            )
            for session in sessions:
                record = by_key.get(session.peer_public_key.strip().encode())
                if record is None:
                    continue
                matched += 1
                session.dht_seen_at = now
                swarm_rate = float(record.get("samples_per_second") or 0.0)
                session.dht_samples_per_second = swarm_rate
                # heartbeats that claim far more than the swarm sees count against the session's credits
                if session.samples_per_second > _MISMATCH_FACTOR * swarm_rate + _MISMATCH_SLACK:
                    session.flagged_heartbeats += 1
                session.dht_epoch = int(record.get("epoch") or 0)
        return matched

    def shutdown(self) -> None:
        self.generator.shutdown()
        if self.spot_checker is not None:
            self.spot_checker.shutdown()
        if self.state is not None:
            self.state.shutdown()
        self.dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.swarm", description="Run one run's swarm peer."
    )
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s swarm[%(name)s] %(levelname)s %(message)s")
    from workers.hivemind_logs import quiet_expected_tracebacks

    quiet_expected_tracebacks()  # a volunteer leaving mid-download is a warning, not a traceback
    settings = CoordinatorSettings(data_dir=args.data_dir)  # database URL and swarm options come from the env
    store = Store(settings.resolved_database_url)
    host = args.host or settings.swarm.host or "127.0.0.1"
    peer = SwarmPeer(settings=settings, store=store, run_name=args.run, host=host, port=args.port)
    stopping = False

    def _stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    logger.info("swarm peer for run %s at %s", args.run, " ".join(peer.visible_maddrs()))
    parent = os.getppid()
    try:
        while not stopping:
            if os.getppid() != parent:  # serve died without stopping us (SIGKILL, OOM): do not linger
                logger.warning("serve (pid %d) is gone; swarm peer for run %s exits", parent, args.run)
                break
            try:
                if not peer.poll_once():
                    logger.info("run %s finished; swarm peer exits", args.run)
                    break
            except Exception:
                logger.exception("swarm bookkeeping failed; retrying")
            deadline = time.monotonic() + settings.swarm.poll_interval
            while not stopping and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        peer.shutdown()
        store.close()
    return 0
