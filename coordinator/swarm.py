"""The coordinator's swarm peer for one run: ``python -m coordinator.swarm --data-dir DIR --run NAME``.

Started by ``volunteer-coordinator serve`` (see ``swarm_manager``), one process per active run. It is
the run's bootstrap DHT peer (stable identity in ``DATA_DIR/swarm/``), it uses the same token check as
every worker, and every ``poll_interval`` it:

* writes its reachable multiaddrs into the store (the join answer's ``initial_peers``),
* reads the peers' signed progress records (hivemind's ``<run>_progress`` key) so that the ledger can
  cross-check what sessions claim against what the swarm saw,
* publishes signed revocation records for banned sessions and refuses them itself,
* and, every ``checkpoint_interval``, saves the swarm's current model, evaluated (``coordinator.checkpoints``),
  which it also serves to volunteers who join when nobody else is training.

It also answers the gallery's ``generate`` requests (:class:`GenerateServer`): the web process, which
never imports torch, forwards a caption over a loopback socket whose port and secret are in
``DATA_DIR/swarm/<run>.generate.json`` (mode 0600); this process draws it with the latest checkpoint.

It runs the run's proof-of-training spot checks (:class:`SpotChecker`, in a thread of its own): it claims
the leases ``coordinator.spotchecks`` sampled, recomputes the loss of each peer's shard on the shared model
and records the verdict.

It never trains and never joins an averaging round: the coordinator stays a bookkeeper, not a parameter
server; the checkpoint is a copy of what the volunteers agreed on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from coordinator import spotchecks
from coordinator.authority import TokenAuthority
from coordinator.checkpoints import (
    DEFAULT_KEEP,
    CheckpointStore,
    checkpoint_directory,
    generate_endpoint_file,
)
from coordinator.errors import Conflict, NotFound
from coordinator.models import PeerSession, Run
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from coordinator.volunteers import revoked_sessions
from volunteer_app.protocol import OptimizerSettings
from volunteer_app.states import RunState, SessionState, SpotCheckState

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
            # On a server the peer must be dialable directly; relays and NAT probing only cost CPU.
            use_relay=False,
            auto_nat=False,
            nat_port_map=False,
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
            from coordinator.checkpoints import Checkpointer

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
                interval=max(_MIN_CHECK_INTERVAL, settings.swarm.poll_interval),
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


# Spot checks: how much of the shared model's time one check may take.
CHECK_MICRO_BATCHES = 4
"""Micro-batches of the peer's shard (in the peer's own order) whose loss a check recomputes."""
CHECK_MAX_SAMPLES = 64
"""At most this many samples per recomputed loss, whatever the peer's micro-batch size."""
_MIN_CHECK_INTERVAL = 2.0
_DEFAULT_CHECK_INTERVAL = 5.0
STATE_REFRESH_INTERVAL = 30.0
"""At most one download of the swarm's state per this many seconds on behalf of spot checks."""


def shard_loss(
    runtime: Any,
    model: Any,
    *,
    shard: int,
    seed: int,
    micro_batch_size: int,
    micro_batches: int = CHECK_MICRO_BATCHES,
    max_samples: int = CHECK_MAX_SAMPLES,
) -> float:
    """The mean loss of ``model`` over the first ``micro_batches`` micro-batches of ``shard`` as the peer
    saw them (shuffled by ``seed``, ``micro_batch_size`` samples each), at most ``max_samples`` samples,
    weighted by samples. Eval mode, no gradients, on the CPU."""
    import torch

    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            batches = runtime.shard_batches(
                shard, batch_size=max(1, micro_batch_size), seed=seed, device="cpu"
            )
            for index, batch in enumerate(batches):
                if index >= micro_batches or count >= max_samples:
                    break
                room = max_samples - count
                if runtime.batch_size_of(batch) > room and isinstance(batch, torch.Tensor):
                    batch = batch[:room]
                n = runtime.batch_size_of(batch)
                total += float(runtime.loss(model, batch)) * n
                count += n
    finally:
        model.train(was_training)
    return total / count if count else float("nan")


class SpotChecker:
    """Runs the proof-of-training spot checks of one run, in a background thread of the swarm peer.

    Every ``interval`` seconds it claims at most one pending check (``spotchecks.claim_pending``) and
    recomputes, on the shared model (``state``: the swarm peer's :class:`~coordinator.checkpoints.Checkpointer`,
    the state every joining peer downloads), three losses of :data:`CHECK_MICRO_BATCHES` micro-batches
    (at most :data:`CHECK_MAX_SAMPLES` samples) each: the peer's shard in the peer's own order, control data
    of the same distribution that no lease hands out (shard ``num_shards + shard``), and the peer's shard
    on an untrained model. ``spotchecks.judge_loss`` turns them into a verdict, ``record_verdict`` records it.

    The one-sided judgement needs a shared model at least as trained as the peer's was, so it judges only
    with a model *past* the swarm epoch the peer reported when it completed the lease (in ``local`` and
    ``diloco`` modes peers drift apart within an epoch; the next epoch's state holds the averaged work of
    every peer of the last round). When the model is not past it, the checker downloads the swarm's state
    first (at most once per :data:`STATE_REFRESH_INTERVAL`); if it is still not past it, the check waits
    (it is offered again after a tenth of ``spot_check_timeout``, and expires, settling the credit as it
    stands, after all of it). An untrained model (nothing downloaded, no checkpoint) is at epoch 0 and
    so never judges, and neither does a shared model that scores no better on the shard than an untrained
    one (a state served by a hostile peer, a diverged swarm): that check waits too.

    CPU: one thread (the checkpointer set ``torch.set_num_threads(1)``), 3 x 64 samples forward-only per
    check, one check per ``interval``. The shared model is held under ``state_lock`` only while a check
    reads it; the swarm peer's checkpoints skip a poll rather than wait for it.

    :param clock: unix time (tests move it).
    """

    def __init__(
        self,
        *,
        store: Store,
        settings: CoordinatorSettings,
        run_id: str,
        state: Any,
        state_lock: threading.Lock,
        interval: float = _DEFAULT_CHECK_INTERVAL,
        clock: Any = time.time,
    ):
        self.store = store
        self.settings = settings
        self.run_id = run_id
        self.state = state
        self.state_lock = state_lock
        self.interval = interval
        self.clock = clock
        self.num_shards = max(1, int(state.spec.num_shards(state.config)))
        self._untrained: Any = None
        self._refreshed_at = float("-inf")
        self._refreshed_once = False
        self.decided = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="spot-checks", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check_once()
            except Exception:
                logger.exception("spot check failed; retrying")

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def untrained_model(self) -> Any:
        if self._untrained is None:
            self._untrained = self.state.runtime.build_model()
        return self._untrained

    def _refresh(self) -> None:
        """Download the swarm's current state into the shared model (rate-limited)."""
        now = time.monotonic()
        if now - self._refreshed_at < STATE_REFRESH_INTERVAL:
            return
        self._refreshed_at = now
        try:
            self.state.averager.load_state_from_peers(timeout=30)
        except Exception as exc:
            logger.warning("spot checks: could not download the swarm's state: %s", exc)
        self._refreshed_once = True

    def check_once(self) -> str | None:
        """Claim and decide one pending check. Returns its verdict (``passed``/``failed``), ``deferred`` when
        the shared model is behind the peer's epoch, or None when there was nothing to check."""
        with self.store.write() as db:
            claimed = spotchecks.claim_pending(
                db, run_id=self.run_id, now=self.clock(), settings=self.settings, limit=1
            )
        if not claimed:
            return None
        check = claimed[0]
        runtime = self.state.runtime
        with self.state_lock:
            wanted = check.model_epoch or 0
            if self.state.epoch <= wanted or not self._refreshed_once:
                self._refresh()
            epoch = self.state.epoch
            if epoch <= wanted:
                logger.info(
                    "spot check %s waits: the shared model is at epoch %d, not past the peer's %d",
                    check.check_id, epoch, wanted,
                )  # fmt: skip
                return "deferred"
            args = dict(seed=check.seed, micro_batch_size=check.micro_batch_size)
            recomputed = shard_loss(runtime, self.state.model, shard=check.shard, **args)
            control = shard_loss(runtime, self.state.model, shard=self.num_shards + check.shard, **args)
        untrained = shard_loss(runtime, self.untrained_model(), shard=check.shard, **args)
        if not recomputed < untrained:
            # a shared model no better than an untrained one (a state served by a hostile peer, a diverged
            # swarm) is no yardstick: judging with it would fail honest peers
            logger.warning(
                "spot check %s waits: the shared model (epoch %d) scores %.4f on the shard, an untrained one %.4f",
                check.check_id, epoch, recomputed, untrained,
            )  # fmt: skip
            return "deferred"
        passed, detail = spotchecks.judge_loss(
            check.reported_loss, recomputed, control=control, untrained=untrained
        )
        detail = f"{detail} (shared model at epoch {epoch}, the peer's at {wanted})"
        try:
            with self.store.write() as db:
                spotchecks.record_verdict(
                    db,
                    check_id=check.check_id,
                    passed=passed,
                    detail=detail,
                    now=self.clock(),
                    recomputed_loss=recomputed,
                )
        except (Conflict, NotFound) as exc:  # decided or removed meanwhile (another checker, an expiry)
            logger.info("spot check %s: %s", check.check_id, exc)
            return None
        self.decided += 1
        verdict = SpotCheckState.PASSED if passed else SpotCheckState.FAILED
        log = logger.info if passed else logger.warning
        log("spot check of lease %s (shard %d) %s: %s", check.lease_id, check.shard, verdict, detail)
        return verdict


class GenerateServer:
    """Draws captions with the run's latest checkpoint for the gallery's ``generate`` endpoint.

    Listens on a loopback TCP port (published with a random secret in ``endpoint_file``, mode 0600) and
    answers one request at a time: one JSON line ``{"secret", "prompts": [...]}`` in, one JSON line out,
    ``{"ok": true, "epoch": N, "samples": [EvalSample...]}`` or ``{"ok": false, "error": code,
    "detail": text}``. The model is loaded from the newest intact checkpoint and reloaded when a newer
    one appears; requests time out after ``REQUEST_TIMEOUT`` seconds of silence.

    :param store: the run's checkpoints.
    :param endpoint_file: where the port and secret are published.
    """

    REQUEST_TIMEOUT = 10.0
    MAX_REQUEST_BYTES = 64 * 1024

    def __init__(self, *, store: CheckpointStore, endpoint_file: Path):
        import secrets
        import socketserver
        import threading

        self.store = store
        self.endpoint_file = endpoint_file
        self.secret = secrets.token_urlsafe(24)
        self._loaded: tuple[Path, Any, Any] | None = None  # (checkpoint path, runtime, model)
        self._lock = threading.Lock()
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = owner.REQUEST_TIMEOUT

            def handle(self) -> None:
                try:
                    line = self.rfile.readline(owner.MAX_REQUEST_BYTES + 1)
                except OSError:
                    return
                answer = owner.answer(line)
                with contextlib.suppress(OSError):
                    self.wfile.write(json.dumps(answer).encode() + b"\n")

        self.server = socketserver.TCPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        endpoint_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = endpoint_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"port": self.port, "secret": self.secret, "pid": os.getpid()}, f)
        os.replace(tmp, endpoint_file)
        self.thread = threading.Thread(target=self.server.serve_forever, name="generate", daemon=True)
        self.thread.start()

    def answer(self, line: bytes) -> dict[str, Any]:
        """The answer to one request line (never raises)."""
        import hmac

        from volunteer_app.worker_protocol import MAX_EVAL_PROMPTS, MAX_PROMPT_CHARS

        if len(line) > self.MAX_REQUEST_BYTES:
            return {"ok": False, "error": "request_too_large", "detail": "the request is too large"}
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            return {"ok": False, "error": "bad_request", "detail": "the request is not a JSON object"}
        if not hmac.compare_digest(str(request.get("secret", "")), self.secret):
            return {"ok": False, "error": "forbidden", "detail": "wrong secret"}
        prompts = request.get("prompts")
        if (
            not isinstance(prompts, list)
            or not 1 <= len(prompts) <= MAX_EVAL_PROMPTS
            or not all(isinstance(p, str) and len(p) <= MAX_PROMPT_CHARS for p in prompts)
        ):
            return {"ok": False, "error": "bad_request", "detail": "prompts must be 1 to 16 strings"}
        try:
            with self._lock:
                loaded = self._model()
                if loaded is None:
                    return {
                        "ok": False,
                        "error": "no_checkpoint",
                        "detail": "the run has no checkpoint yet; the swarm peer saves one every few minutes",
                    }
                epoch, runtime, model = loaded
                from workers.evaluation import answer

                samples = answer(runtime, model, prompts)
        except Exception as exc:
            logger.exception("generate failed")
            return {"ok": False, "error": "generate_failed", "detail": f"drawing failed: {exc}"}
        return {"ok": True, "epoch": epoch, "samples": [s.model_dump(mode="json") for s in samples]}

    def _model(self) -> tuple[int, Any, Any] | None:
        from coordinator.checkpoints import MODEL_FILE, build_model_for, load_model_file

        latest = self.store.latest()
        if latest is None:
            return None
        if self._loaded is None or self._loaded[0] != latest.path:
            runtime, model = build_model_for(latest.manifest)
            load_model_file(model, latest.path / MODEL_FILE)
            model.eval()
            self._loaded = (latest.path, runtime, model)
            logger.info("generate: using the checkpoint of epoch %d", latest.epoch)
        return latest.epoch, self._loaded[1], self._loaded[2]

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.endpoint_file.unlink()
        self.server.shutdown()
        self.server.server_close()


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


if __name__ == "__main__":
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    sys.exit(main())
