"""One contribution: this machine training one run, from registration to leaving.

:class:`Contribution` is the front object that composes the parts, the way ``hivemind.Optimizer``
composes its averagers: the :class:`~volunteer_app.agent.link.CoordinatorLink` (HTTP with retries), the
:class:`~volunteer_app.agent.worker.WorkerProcess` and its :class:`~volunteer_app.agent.worker.RestartBudget`,
the :class:`~volunteer_app.agent.leases.LeaseKeeper` with its :class:`~volunteer_app.agent.outbox.Outbox`,
and the speed-test cache. Its :class:`~volunteer_app.control.ContributionState` is what UIs show.

The lifecycle: register once (the credential is kept in the config dir), read the run, measure the
machine (cached), join, start the worker, then heartbeat, keep leases and restart a crashed worker
until told to stop; a session the coordinator ended is joined again. Stopping lets the worker finish its
step and leave the swarm, sends every waiting report and returns the session's unfinished leases.

Pausing comes from outside (the agent service: the volunteer, the resource policy, finish) through
:meth:`Contribution.set_pause` and from the organizers (heartbeat commands); the worker is paused while
either asks, and keeps the samples it accumulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import math
import platform
import re
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from volunteer_app import __version__
from volunteer_app.agent.cache import CacheError, FileCache
from volunteer_app.agent.clock import Clock, SystemClock
from volunteer_app.agent.dialback import DialbackListener, port_free
from volunteer_app.agent.leases import RETURN_MARGIN_SECONDS, LeaseKeeper
from volunteer_app.agent.link import CoordinatorLink, Stopped, backoff_delay
from volunteer_app.agent.outbox import Outbox
from volunteer_app.agent.speedtest import RunRefused, SpeedTestCache, measure_speed
from volunteer_app.agent.worker import RestartBudget, WorkerProcess
from volunteer_app.client import (
    CoordinatorClient,
    CoordinatorRefused,
    CoordinatorUnreachable,
    CredentialStore,
    StoredCredential,
    normalize_url,
)
from volunteer_app.control import ContributionState, Evaluation, EvaluationSample, PolicySettings
from volunteer_app.identity import ensure_rsa_key, public_key_openssh
from volunteer_app.netcheck import check_peer_addresses
from volunteer_app.profile import profile_machine
from volunteer_app.protocol import (
    HardwareProfile,
    HeartbeatRequest,
    JoinRequest,
    JoinResponse,
    RegisterRequest,
    RunFile,
    RunOut,
    TrainingFigures,
)
from volunteer_app.states import WorkerState, heartbeat_state
from volunteer_app.worker_protocol import (
    EXIT_RUN_REFUSED,
    AveragedEvent,
    ErrorEvent,
    EvalEvent,
    EvaluateCommand,
    LeaseCommand,
    LeaseDoneEvent,
    LimitsCommand,
    NeedLeaseEvent,
    PauseCommand,
    ProgressEvent,
    ReadyEvent,
    ResumeCommand,
    StateEvent,
    StoppedEvent,
    TokenCommand,
    WorkerEvent,
    WorkerStart,
)

logger = logging.getLogger(__name__)

LONG_PAUSE_SECONDS = 120.0
"""Paused this long, the agent starts giving back leases it can no longer finish before their deadline."""

CLOCK_SKEW_WARNING = 20.0
DEFAULT_MEMORY_FRACTION = 0.8
"""Without a ``max_memory_gb`` setting, training may use this fraction of the computer's RAM at most."""


ISOLATED_AFTER_ROUNDS = 3
"""Averaging rounds failed in a row (and none done since) after which the agent says its worker is cut off from
the swarm's averaging, with why where the coordinator's reachability verdict tells."""

REACHABILITY_SHOWN = {
    "direct": "other peers dial it directly",
    "relayed": "other peers reach it through the coordinator's relay",
    "client": "it takes part as a client (nobody can dial it; it averages through reachable peers)",
}


class AgentError(Exception):
    """The contribution cannot go on (banned, no such run, a damaged credential store...)."""

    def __init__(self, message: str, *, code: str = "agent_error"):
        super().__init__(message)
        self.code = code


def default_name() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "volunteer"
    raw = f"{user}-{platform.node().split('.')[0]}"
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", raw).strip("-._")[:40]
    return name or "volunteer"


class Contribution:
    """Contributes this machine to one run until stopped.

    :param settings: the agent's program settings (config dir, network, restarts...).
    :param coordinator: the coordinator's URL. :param run: the run's name.
    :param name: the public name used when registering (default: ``user-host``).
    :param policy: the volunteer's limits (threads, device, memory); the agent service keeps it current.
    :param duration: leave by itself after this many seconds of training (None: until stopped).
    :param max_samples: leave by itself once this many samples are trained.
    :param evaluate_on_stop: have the worker evaluate the model before it exits (the demo's summary).
    :param on_message: one-line messages worth showing (joined, credited, reconnecting...).
    :param clock: time for every timeout, backoff and duration.
    """

    def __init__(
        self,
        *,
        settings: Any,
        coordinator: str,
        run: str,
        name: str | None = None,
        invite_code: str | None = None,
        policy: PolicySettings | None = None,
        duration: float | None = None,
        max_samples: int | None = None,
        evaluate_on_stop: bool = False,
        evaluate_max_samples: int | None = None,
        on_message: Callable[[str], None] | None = None,
        clock: Clock | None = None,
    ):
        self.settings = settings
        self.coordinator = normalize_url(coordinator)
        self.run_name = run
        self.name = name or settings.name or default_name()
        self.invite_code = invite_code if invite_code is not None else settings.invite_code
        self.policy = policy or PolicySettings(
            max_threads=settings.max_threads, max_memory_gb=settings.max_memory_gb, device=settings.device
        )
        self.duration = duration
        self.max_samples = max_samples
        self.evaluate_on_stop = evaluate_on_stop
        self.evaluate_max_samples = evaluate_max_samples
        self.on_message = on_message or (lambda _message: None)
        self.clock = clock or SystemClock()
        # how long to wait for the run's swarm address after joining (below the coordinator's session timeout)
        self.swarm_wait = 60.0
        self.status = ContributionState(
            coordinator=self.coordinator, run=run, name=self.name, started_at=self.clock.time()
        )
        self.profile: HardwareProfile | None = None
        self.run_info: RunOut | None = None
        self.stop_event = asyncio.Event()
        self._link: CoordinatorLink | None = None
        self._join: JoinResponse | None = None
        self._worker: WorkerProcess | None = None
        self._prestarted: WorkerProcess | None = None
        self._progress: ProgressEvent | None = None
        self._usual_rate = 0.0
        self._paused_since: float | None = None
        self._pause_reasons: list[str] = []
        self._pause_by: str | None = None
        self._paused_by_organizers = False
        self._worker_paused = False
        self._listen_port = 0  # the worker's swarm port, dialled back at each join (kept across rejoins)
        self._last_averaged = (0, 0)  # the worker's (averaging_rounds, failed_rounds) when it last averaged
        # when the coordinator last dialled this computer back (at a join)
        self._reachability_checked = -math.inf
        self._chores: set[asyncio.Task[Any]] = set()  # background work started from event handlers
        self._rejoin = False
        self._restart_reason: str | None = None
        self._training_started: float | None = None
        self._samples_base = 0
        self._compute_base = 0.0
        self._evaluations: dict[str, asyncio.Future[Evaluation]] = {}
        self.on_finished_lease: Callable[[], None] | None = None
        self.last_evaluation: Evaluation | None = None
        self.outbox = Outbox(
            settings.config_dir / "outbox.json",
            on_damaged=lambda kept: self.on_message(f"the report outbox was damaged; it was kept as {kept}"),
            on_unreadable=lambda item: self.on_message(
                f"dropped an unreadable report from the outbox: {str(item)[:120]}"
            ),
        )
        self.leases: LeaseKeeper | None = None
        self.files = FileCache(
            settings.cache_dir / "files", budget_bytes=int(getattr(settings, "cache_max_gb", 10.0) * 2**30)
        )
        self.run_files: dict[str, str] = {}
        """SHA-256 -> cached path of every file of the run this agent fetched and checked."""

    # ------------------------------------------------------------------ public
    @property
    def joined(self) -> bool:
        return self._join is not None

    @property
    def worker_pids(self) -> list[int]:
        return [p for p in (self._worker.pid if self._worker else None,) if p is not None]

    @property
    def on_gpu(self) -> bool:
        return bool(self._join is not None and self._join.assignment.device == "cuda")

    def request_stop(self, reason: str = "stopped by the volunteer") -> None:
        if not self.stop_event.is_set():
            self.status.stop_reason = self.status.stop_reason or reason
            self.stop_event.set()

    async def set_pause(self, reasons: list[str], *, by: str | None) -> None:
        """Pause (non-empty ``reasons``) or resume on behalf of the volunteer or the policy."""
        self._pause_reasons, self._pause_by = list(reasons), by if reasons else None
        await self._apply_pause()

    async def pause(self) -> None:
        await self.set_pause(["paused by you"], by="volunteer")

    async def resume(self) -> None:
        await self.set_pause([], by=None)

    async def _apply_pause(self) -> None:
        reasons = list(self._pause_reasons)
        if self._paused_by_organizers:
            reasons.append("paused by the run's organizers")
        self.status.pause_reasons = reasons
        self.status.paused_by = self._pause_by or ("organizers" if self._paused_by_organizers else None)
        paused = bool(reasons)
        if paused != self._worker_paused and self._worker is not None and self._worker.started:
            await self._worker.send(PauseCommand() if paused else ResumeCommand())
        self._worker_paused = paused
        self._update_taking()
        if not paused:
            self._paused_since = None
        elif self._paused_since is None:
            self._paused_since = self.clock.time()

    async def set_finishing(self, finishing: bool) -> None:
        """Finish: take no new lease; once the current one is reported, ``on_finished_lease`` is called."""
        self.status.finishing = finishing
        self._update_taking()
        if finishing and self.status.lease_id is None and self.status.state != "training":
            self._finished_lease()

    def _finished_lease(self) -> None:
        self.status.finishing = False
        if self.on_finished_lease is not None:
            self.on_finished_lease()  # the service pauses; resuming takes leases again (_apply_pause)
        else:
            self._update_taking()

    def _update_taking(self) -> None:
        """New leases are taken unless finishing or paused (a lease taken while paused would only sit
        there, its deadline running); once that ends, the keeper asks at once rather than when the worker
        next asks (the worker asked while finishing, and was not given any)."""
        if self.leases is None:
            return
        taking = not self.status.finishing and not self._worker_paused
        if taking and not self.leases.taking:
            self.leases.wanted.set()
        self.leases.taking = taking

    async def apply_policy(self, policy: PolicySettings) -> str | None:
        """Take new limits. Returns why the worker restarts, when a change cannot be applied live."""
        old, self.policy = self.policy, policy
        if old.device != policy.device:
            await self._restart("the training device changed", rejoin=True)
            return "the worker restarts to move training between the CPU and the GPU"
        if old.max_memory_gb != policy.max_memory_gb:
            await self._restart("the memory cap changed", rejoin=False)
            return "the worker restarts to fit its micro-batch into the new memory cap"
        if old.max_threads != policy.max_threads:
            await self._apply_threads()
        return None

    async def _apply_threads(self) -> None:
        """The thread limit, applied live by the worker between micro-batches."""
        limit = self.policy.max_threads
        cores = self.profile.cpu_cores if self.profile is not None else None
        if self._join is not None and self._join.assignment.device == "cuda":
            cores = min(cores or 2, 2)
        threads = min(limit, cores) if limit is not None and cores is not None else (limit or cores)
        if threads is not None:
            await self._send(LimitsCommand(threads=max(1, threads)))

    async def _restart(self, reason: str, *, rejoin: bool) -> None:
        if self._worker is None:
            return
        self.status.restart_pending = reason
        self._restart_reason = reason
        if rejoin:
            self._rejoin = True
        self.on_message(f"{reason}: restarting the training worker")
        await self._worker.stop(grace=60.0, on_late=self.on_message)

    async def evaluate(self, prompts: list[str] | None = None, *, timeout: float = 300.0) -> Evaluation:
        """The worker evaluates the shared model now: its metric and drawings of ``prompts``."""
        if self._worker is None or not self._worker.running:
            raise AgentError(
                "the training worker is not running yet; try again once it trains", code="not_ready"
            )
        request_id = uuid.uuid4().hex[:12]
        future: asyncio.Future[Evaluation] = asyncio.get_running_loop().create_future()
        self._evaluations[request_id] = future
        try:
            await self._worker.send(EvaluateCommand(request_id=request_id, prompts=prompts))
            return await asyncio.wait_for(future, timeout=timeout)
        except asyncio.TimeoutError:
            raise AgentError("the worker did not finish the evaluation in time", code="timeout") from None
        finally:
            self._evaluations.pop(request_id, None)

    async def close(self, reason: str = "stopped") -> None:
        """Give up before :meth:`run`: stop, and release what :meth:`connect` or a prestart took."""
        self.request_stop(reason)
        await self._shutdown()
        if self.status.state != "failed":
            self.status.state = "stopped"

    async def prestart_worker(self) -> None:
        """Start the worker process now, so that its imports run while registering and joining."""
        if self._prestarted is None:
            self._prestarted = self._new_worker()
            await self._prestarted.prestart()

    async def connect(self) -> None:
        """Register (once), read the run, measure this machine and join. Raises :class:`AgentError`."""
        self.settings.config_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            credential = await self._register()
            client = CoordinatorClient(self.coordinator, credential=credential.credential)
            self._link = CoordinatorLink(
                client=client,
                clock=self.clock,
                stop=self.stop_event,
                on_message=self.on_message,
                on_reachable=self._reachable,
            )
            link = self._link
            try:
                self.run_info = await link.call(
                    "reach the coordinator", lambda: client.get_run(self.run_name)
                )
            except CoordinatorRefused as exc:
                raise self._refusal(exc) from exc
            self.status.task = self.run_info.task
            await self._check_clock()
            await self._fetch_files(self.run_info.files, before_join=True)
            self.profile = await self._profile(self.run_info)
            self.leases = LeaseKeeper(
                link=link,
                outbox=self.outbox,
                coordinator=self.coordinator,
                clock=self.clock,
                status=self.status,
                send=self._send,
                on_message=self.on_message,
                on_refused=self._refused,
                on_run_finished=lambda: self.request_stop("the run has finished"),
            )
            self._update_taking()  # its run() asks for leases at start when taking
            await self.leases.flush()
            self._join = await self._join_run(self.profile)
        except Stopped as exc:
            raise AgentError(str(exc), code="stopped") from exc

    async def run(self) -> ContributionState:
        """Connect (unless :meth:`connect` was called), then train until stopped; the final state."""
        try:
            if self._join is None and not self.stop_event.is_set():
                await self.connect()
            while self._join is not None and not self.stop_event.is_set():
                self._rejoin = False
                self._restart_reason = None
                await self._await_swarm_address()
                await self._supervise()
                if not self._rejoin or self.stop_event.is_set():
                    break
                await self._leave_session()
                self.on_message("joining the run again")
                assert self.profile is not None
                self._join = await self._join_run(self.profile)
        except Stopped:
            pass
        except AgentError as exc:
            if not self.stop_event.is_set():  # a stop while still connecting is not a failure
                self.status.state = "failed"
                self.status.last_error = str(exc)
                raise
        finally:
            await self._shutdown()
        self.status.state = "stopped"
        return self.status

    # ------------------------------------------------------------------ setup
    def _reachable(self, ok: bool) -> None:
        self.status.coordinator_ok = ok

    def _refusal(self, exc: CoordinatorRefused) -> AgentError:
        if exc.status == 404 and exc.code == "run_not_found":
            return AgentError(f"the coordinator has no run named {self.run_name!r}", code="run_not_found")
        return AgentError(f"the coordinator refused: {exc.detail}", code=exc.code)

    async def _register(self) -> StoredCredential:
        store = CredentialStore(self.settings.credentials_path)
        try:
            stored = store.get(self.coordinator)
        except Exception as exc:
            raise AgentError(str(exc), code="credential_store") from exc
        if stored is not None:
            self.name = self.status.name = stored.name
            return stored
        self.status.state = "registering"
        client = CoordinatorClient(self.coordinator)
        link = CoordinatorLink(
            client=client, clock=self.clock, stop=self.stop_event, on_message=self.on_message,
            on_reachable=self._reachable,
        )  # fmt: skip
        try:
            request = RegisterRequest(name=self.name, invite_code=self.invite_code)
            answer = await link.call("register", lambda: client.register(request))
        except ValidationError as exc:
            raise AgentError(
                f"invalid volunteer name {self.name!r}: use letters, digits, '_', '.', '-' (at most 40)",
                code="invalid_name",
            ) from exc
        except CoordinatorRefused as exc:
            if exc.code == "name_taken":
                raise AgentError(
                    f"the name {self.name!r} is taken on this coordinator; choose another", code="name_taken"
                ) from exc
            raise AgentError(f"registration refused: {exc.detail}", code=exc.code) from exc
        finally:
            await client.aclose()
        stored = StoredCredential(self.coordinator, answer.volunteer_id, answer.name, answer.credential)
        store.put(stored)
        self.name = self.status.name = answer.name
        self.on_message(f"registered as {answer.name}; the credential is in {self.settings.credentials_path}")
        return stored

    async def _check_clock(self) -> None:
        with contextlib.suppress(CoordinatorUnreachable, CoordinatorRefused):
            skew = await self._link_().client.server_time() - self.clock.time()
            if abs(skew) > CLOCK_SKEW_WARNING:
                self.on_message(
                    f"this computer's clock is {skew:+.0f} s off the coordinator's; peers refuse requests more "
                    "than 60 s off, so please synchronize the clock (NTP)"
                )

    def memory_limit(self, profile: HardwareProfile | None = None) -> int | None:
        """The most memory training may use here: the volunteer's ``max_memory_gb``, else 80 % of the RAM."""
        if self.policy.max_memory_gb:
            return int(self.policy.max_memory_gb * 2**30)
        profile = profile or self.profile
        return int(profile.ram_bytes * DEFAULT_MEMORY_FRACTION) if profile and profile.ram_bytes else None

    async def _profile(self, run: RunOut, *, refresh: bool = False) -> HardwareProfile:
        """The machine's profile with the run's speed test, after checking the run as the worker will (its
        task installed, its files, its model within the memory limit): raises :class:`AgentError`
        (``run_refused``) for a run this machine will not train, before joining it."""
        self.status.state = "profiling"
        base = await asyncio.to_thread(profile_machine, accepts_connections=self.settings.accepts_connections)
        if any(f.sha256 not in self.run_files for f in run.files):
            # an invite-only run serves its files to members only, and this volunteer becomes one by joining:
            # the worker checks the run once they are fetched
            self.on_message("the run's files come after joining; the speed test is skipped this time")
            return base
        try:
            benchmark = await measure_speed(
                run=run,
                profile=base,
                cache=SpeedTestCache(self.settings.config_dir / "benchmarks.json"),
                seconds=self.settings.benchmark_seconds,
                max_threads=self.policy.max_threads,
                device=self.policy.device,
                on_message=self.on_message,
                work_dir=self.settings.work_dir,
                memory_limit=self.memory_limit(base),
                files={f.sha256: self.run_files[f.sha256] for f in run.files if f.sha256 in self.run_files},
                cache_dir=self.files.root,
                refresh=refresh,
            )
        except RunRefused as exc:
            raise AgentError(f"not joining run {self.run_name}: {exc}", code="run_refused") from exc
        return base.model_copy(update={"benchmark": benchmark})

    async def _fetch_files(self, files: list[RunFile], *, before_join: bool = False) -> None:
        """Fetch the run's files into the cache and check them (:class:`~volunteer_app.agent.cache.FileCache`).

        Before joining, an invite-only run may not serve its files yet (this volunteer becomes a member by
        joining): then they are fetched after the join, and the speed test checks the run without them."""
        keep = {f.sha256 for f in files}
        for file in files:
            if file.sha256 in self.run_files:
                continue
            shown = f"the run's file {file.field} ({file.bytes / 1e6:.1f} MB)"
            self.status.state = "downloading"

            def progress(done: int, total: int, shown: str = shown) -> None:
                self.status.download = f"{shown}: {done / max(1, total):.0%}"

            try:
                path = await self._link_().call(
                    "download the run's files",
                    lambda file=file: self.files.fetch(  # type: ignore[misc]
                        self._link_().client, run=self.run_name, file=file, keep=keep, on_progress=progress
                    ),
                )
            except CoordinatorRefused as exc:
                if before_join and exc.code == "invite_required":
                    return
                raise AgentError(f"cannot download {shown}: {exc.detail}", code=exc.code) from exc
            except CacheError as exc:
                raise AgentError(f"not joining run {self.run_name}: {exc}", code=exc.code) from exc
            finally:
                self.status.download = None
            self.run_files[file.sha256] = str(path)
            self.on_message(f"downloaded and checked {shown}")

    async def _check_join(self, answer: JoinResponse) -> JoinResponse:
        """The join answer, once what it asks of this computer is checked: its files fetched and checked,
        and its swarm addresses only where the coordinator may send this computer (:mod:`volunteer_app.netcheck`).

        :raises AgentError: when none of the swarm addresses may be dialled."""
        await self._fetch_files(answer.run.files)
        return answer.model_copy(update={"initial_peers": self._dialable(answer.initial_peers)})

    def _dialable(self, maddrs: list[str]) -> list[str]:
        checked = check_peer_addresses(maddrs, coordinator_url=self.coordinator)
        for maddr, reason in checked.refused:
            self.on_message(f"refusing the swarm address {maddr[:120]} from the coordinator: {reason}")
        if maddrs and not checked.kept:
            maddr, reason = checked.refused[0]
            raise AgentError(
                "the coordinator named only swarm addresses this computer must not dial (such as "
                f"{maddr[:120]}: {reason}); not joining",
                code="addresses_refused",
            )
        return checked.kept

    async def refresh_profile(self) -> HardwareProfile:
        """Profile the machine again and re-measure the speed (used at the next join)."""
        if self.run_info is None:
            raise AgentError("not joined to a run yet", code="not_ready")
        state = self.status.state
        try:
            self.profile = await self._profile(self.run_info, refresh=True)
        finally:
            if self.status.state == "profiling":
                self.status.state = state
        return self.profile

    async def _join_run(self, profile: HardwareProfile) -> JoinResponse | None:
        self.status.state = "joining"
        public_key = public_key_openssh(ensure_rsa_key(self.key_path()))
        link = self._link_()
        attempt = 0
        while not self.stop_event.is_set():
            # the worker's port listens during the join, so that the coordinator can tell whether other peers
            # can dial it (coordinator/reachability.py); the worker listens there afterwards
            try:
                listener = DialbackListener(self.settings.listen_host, self._listen_port)
            except OSError as exc:
                raise AgentError(
                    f"cannot listen on {self.settings.listen_host} for the swarm: {exc.strerror or exc}",
                    code="cannot_listen",
                ) from exc
            self._listen_port = listener.port
            request = JoinRequest(
                profile=profile,
                agent_version=__version__,
                peer_public_key=public_key,
                invite_code=self.invite_code,
                max_threads=self.policy.max_threads,
                device=self.policy.device,
                listen_port=listener.port,
                dialback_nonce=listener.nonce,
            )
            try:
                with listener:
                    answer: JoinResponse = await link.call(
                        "join",
                        lambda request=request: link.client.join(self.run_name, request),  # type: ignore[misc]
                    )
            except CoordinatorRefused as exc:
                if exc.code in ("run_paused", "rate_limited") or exc.status == 429:
                    attempt += 1
                    delay = (
                        60.0
                        if exc.code == "run_paused"
                        else (exc.retry_after or backoff_delay(attempt, initial=5.0))
                    )
                    self.status.state = "waiting"
                    self.on_message(f"{exc.detail}; trying again in {delay:.0f} s")
                    await self.clock.wait(self.stop_event, delay)
                    continue
                if exc.code == "run_finished":
                    self.status.stop_reason = exc.detail
                    self.on_message(exc.detail)
                    self.request_stop(exc.detail)
                    return None
                if exc.code == "invalid_credential" and attempt == 0:
                    # the coordinator no longer knows this credential (its store was reset): register again
                    attempt += 1
                    CredentialStore(self.settings.credentials_path).forget(self.coordinator)
                    self.on_message(
                        "the coordinator does not know this machine's credential; registering again"
                    )
                    stored = await self._register()
                    link.client.credential = stored.credential
                    continue
                raise AgentError(
                    f"the coordinator refused to let this machine join: {exc.detail}", code=exc.code
                ) from exc
            answer = await self._check_join(answer)
            self.status.session_id = answer.session_id
            assert self.leases is not None
            self.leases.reset(answer.session_id, answer.lease)
            a = answer.assignment
            self._reachability_checked = self.clock.time()
            self.status.reachability = a.reachability
            self.status.reachability_reason = a.reachability_reason
            self.on_message(
                f"joined run {self.run_name} as {self.name} (session {answer.session_id[:8]}): {a.device}, "
                f"{a.threads} thread(s), micro-batch {a.micro_batch_size}; {REACHABILITY_SHOWN[a.reachability]}"
                + (f" ({a.reachability_reason})" if a.reachability_reason else "")
            )
            return answer
        return None

    async def _await_swarm_address(self) -> None:
        """Make sure the worker knows where the run's swarm is before it starts.

        The coordinator's swarm peer publishes its address a few seconds after ``serve`` (re)starts; a
        worker started without it would train alone in a swarm of its own, never averaging with anyone.
        So wait for the address (bounded: a coordinator without swarm peers still lets us train).
        """
        assert self._join is not None
        if self._join.initial_peers:
            return
        self.status.state = "waiting"
        self.on_message("the run's swarm peer is starting; waiting for its address")
        deadline = self.clock.monotonic() + self.swarm_wait
        while not self.stop_event.is_set() and self.clock.monotonic() < deadline:
            await self.clock.wait(self.stop_event, 1.0)
            if not self.stop_event.is_set() and await self._refresh_swarm_address():
                self.on_message("found the run's swarm")
                return
        if not self.stop_event.is_set():
            self.on_message(
                f"the coordinator gave no swarm address in {self.swarm_wait:.0f} s; training without a swarm "
                "until the next rejoin"
            )

    async def _refresh_swarm_address(self) -> bool:
        """Take the swarm's current address into the join answer (the coordinator's swarm peer may have
        moved, e.g. after a ``serve`` restart); keep the old one when the coordinator cannot say.
        Returns whether the worker now has an address to bootstrap from."""
        if self._join is None or self._link is None:
            return False
        try:
            run = await asyncio.wait_for(self._link.client.get_run(self.run_name), timeout=15)
        except (CoordinatorUnreachable, CoordinatorRefused, asyncio.TimeoutError):
            return bool(self._join.initial_peers)
        if run.initial_peers and run.initial_peers != self._join.initial_peers:
            try:
                dialable = self._dialable(run.initial_peers)
            except AgentError:
                dialable = []
            if dialable:
                self._join = self._join.model_copy(update={"initial_peers": dialable})
        return bool(self._join.initial_peers)

    def key_path(self) -> Path:
        host = re.sub(r"[^A-Za-z0-9.\-]", "_", self.coordinator.split("://", 1)[1])
        return self.settings.keys_dir / f"{host}-{self.run_name}.rsa"

    def worker_log(self) -> Path:
        return self.settings.logs_dir / f"worker-{self.run_name}.log"

    def _link_(self) -> CoordinatorLink:
        assert self._link is not None
        return self._link

    # ------------------------------------------------------------------ supervision
    async def _supervise(self) -> None:
        assert self.leases is not None
        session_stop = asyncio.Event()
        tasks = [
            asyncio.create_task(self._heartbeats(session_stop), name="heartbeats"),
            asyncio.create_task(self.leases.run(session_stop), name="leases"),
            asyncio.create_task(self._watch_stop(session_stop), name="stop-watch"),
        ]
        if self.duration is not None:
            tasks.append(asyncio.create_task(self._stop_after_duration(), name="duration"))
        budget = RestartBudget(limit=self.settings.worker_restarts, clock=self.clock)
        try:
            while not self.stop_event.is_set() and not self._rejoin:
                code = await self._run_worker()
                if self.stop_event.is_set() or self._rejoin:
                    break
                if self._restart_reason is not None:  # a restart we asked for: no backoff, no budget
                    self._restart_reason = self.status.restart_pending = None
                    continue
                if code == EXIT_RUN_REFUSED:  # the worker refused the run: starting it again cannot help
                    raise AgentError(
                        self.status.last_error or f"the training worker refused run {self.run_name}",
                        code="run_refused",
                    )
                self.status.worker_restarts += 1
                delay = budget.failed()
                if delay is None:
                    raise AgentError(
                        f"the training worker keeps failing (exit status {code}); see {self.worker_log()} and the "
                        f"last error: {self.status.last_error}",
                        code="worker_failing",
                    )
                self.on_message(
                    f"the training worker exited with status {code}; restarting it in {delay:.0f} s"
                )
                self.status.state = "restarting"
                await self.clock.wait(self.stop_event, delay)
                await self._refresh_swarm_address()
        finally:
            session_stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_stop(self, session_stop: asyncio.Event) -> None:
        """Stop the worker gracefully once the contribution stops or the session must be joined again."""
        while not (self.stop_event.is_set() or self._rejoin):
            await self.clock.wait(self.stop_event, 0.2)
        session_stop.set()
        if self._worker is not None:
            self.status.state = "stopping"
            grace = 180.0 if self.evaluate_on_stop else 60.0
            await self._worker.stop(grace=grace, evaluate=self.evaluate_on_stop, on_late=self.on_message)

    async def _stop_after_duration(self) -> None:
        assert self.duration is not None
        while self._training_started is None:
            await self.clock.sleep(0.2)
        remaining = self.duration - (self.clock.monotonic() - self._training_started)
        await self.clock.sleep(max(0.0, remaining))
        self.request_stop(f"ran for the requested {self.duration:.0f} s")

    def _new_worker(self) -> WorkerProcess:
        return WorkerProcess(
            log_path=self.worker_log(), on_event=self._handle_event, work_dir=self.settings.work_dir
        )

    async def _worker_port(self) -> int:
        """The port dialled back at join, once free: a restarted worker's previous swarm daemon may hold it
        for a few seconds. If it stays taken, any free port (0): relayed and client workers are reached
        the same way on it; a direct one is until the next join checks it again."""
        port, host = self._listen_port, self.settings.listen_host
        if not port:
            return 0
        for _ in range(20):
            if port_free(host, port):
                return port
            await self.clock.sleep(0.5)
        self.on_message(
            f"port {port} is still taken (by an earlier worker's swarm daemon?): listening on another"
        )
        return 0

    async def _run_worker(self) -> int:
        """Start the worker with the current join answer and leases; return its exit status."""
        assert self._join is not None and self.leases is not None
        self.status.state = "starting"
        leases = self.leases.leases()
        join = self._join.model_copy(update={"lease": leases[0] if leases else None})
        limits = self.policy
        start = WorkerStart(
            join=join,
            peer_key_path=str(self.key_path()),
            listen_host=self.settings.listen_host,
            listen_port=await self._worker_port(),
            announce_host=self.settings.announce_host,
            max_memory_bytes=int(limits.max_memory_gb * 2**30) if limits.max_memory_gb else None,
            memory_limit_bytes=self.memory_limit(),
            cache_dir=str(self.files.root),
            files={f.sha256: self.run_files[f.sha256] for f in join.run.files if f.sha256 in self.run_files},
            evaluate_on_stop=self.evaluate_on_stop,
            evaluate_max_samples=self.evaluate_max_samples,
            log_level=self.settings.log_level,
        )
        worker, self._prestarted = self._prestarted or self._new_worker(), None
        self._worker = worker
        commands: list[Any] = [LeaseCommand(lease=lease) for lease in leases[1:]]
        paused = bool(self._pause_reasons) or self._paused_by_organizers
        if paused:
            commands.append(PauseCommand())
        self._worker_paused = paused
        try:
            await worker.start(start, commands)
            code = await worker.wait()
        finally:
            worker.kill()
            self._worker = None
        # a restarted worker counts from zero again; keep the session's totals growing
        self._samples_base = self.status.samples_total
        self._compute_base = self.status.compute_seconds
        self._progress = None
        self._last_averaged = (0, 0)  # the next worker counts its rounds from zero
        for future in self._evaluations.values():
            if not future.done():
                future.set_exception(
                    AgentError("the worker stopped before the evaluation finished", code="stopped")
                )
        return code

    async def _send(self, command: Any) -> bool:
        worker = self._worker
        if worker is None or not worker.started:
            return False
        return await worker.send(command)

    async def _handle_event(self, event: WorkerEvent) -> None:
        s = self.status
        if isinstance(event, StateEvent):
            # A worker process that ended says "stopped"; whether the contribution has stopped is the agent's
            # call (it restarts a worker that stopped unasked, and says "stopped" itself when it is done).
            if event.state != "stopped":
                s.state = event.state
            if event.detail:
                self.on_message(event.detail)
        elif isinstance(event, ReadyEvent):
            s.parameters, s.device, s.threads = event.parameters, event.device, event.threads
            s.micro_batch_size = event.micro_batch_size
            s.maddrs, s.loaded_state_epoch = event.maddrs, event.loaded_state_epoch
            s.restart_pending = None
            if self._training_started is None:
                self._training_started = self.clock.monotonic()
            loaded = (
                f", loaded the swarm's state at epoch {event.loaded_state_epoch}"
                if event.loaded_state_epoch
                else ""
            )
            self.on_message(
                f"worker ready: {event.parameters / 1e6:.2f}M parameters on {event.device}{loaded}"
            )
        elif isinstance(event, ProgressEvent):
            self._progress = event
            if event.samples_total > 0 and s.first_sample_at is None:
                s.first_sample_at = self.clock.time()
            if event.loss is not None and s.first_loss is None:
                s.first_loss = event.loss
            for name, value in TrainingFigures.of(event).figures().items():
                setattr(s, name, value)
            s.samples_total = self._samples_base + event.samples_total  # the session's, across restarts
            if self.max_samples is not None and s.samples_total >= self.max_samples:
                self.request_stop(f"trained the requested {self.max_samples} samples")
            if event.samples_per_second > 0 and event.state == WorkerState.TRAINING:
                self._usual_rate = event.samples_per_second  # what finishing a lease after a pause will take
            s.failed_rounds = event.failed_rounds
            self._watch_isolation(event)
            s.lease_id = event.lease_id
            s.lease_samples_done, s.lease_samples = event.lease_samples_done, event.lease_samples
            lease = self.leases.outstanding.get(event.lease_id or "") if self.leases else None
            s.lease_shard = lease.shard if lease is not None else None
            s.compute_seconds = self._compute_base + event.compute_seconds
            if event.threads is not None:
                s.threads = event.threads
            if s.finishing and event.lease_id is None and event.state in ("waiting", "paused"):
                self._finished_lease()
        elif isinstance(event, AveragedEvent):
            if event.ok and event.group_bytes > 0 and s.first_round_at is None:
                s.first_round_at = self.clock.time()
        elif isinstance(event, LeaseDoneEvent):
            assert self.leases is not None
            await self.leases.finished(event)
            if s.finishing:
                self._finished_lease()
        elif isinstance(event, NeedLeaseEvent):
            if self.leases is not None:
                self.leases.wanted.set()
        elif isinstance(event, EvalEvent):
            self._evaluated(event)
        elif isinstance(event, ErrorEvent):
            s.last_error = event.message
            self.on_message(("fatal: " if event.fatal else "") + event.message)
        elif isinstance(event, StoppedEvent):
            s.samples_total = self._samples_base + event.samples_total

    def _background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._chores.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._chores.discard)

    def _watch_isolation(self, event: ProgressEvent) -> None:
        """Say so when the worker has failed :data:`ISOLATED_AFTER_ROUNDS` averaging rounds in a row while others
        train (its work is not reaching the shared model), and again when it averages once more."""
        s = self.status
        rounds, failed = self._last_averaged
        if event.averaging_rounds > rounds or event.failed_rounds < failed:
            self._last_averaged = (event.averaging_rounds, event.failed_rounds)
            if s.isolated is not None and event.averaging_rounds > rounds:
                s.isolated = None
                self.on_message("averaging with the swarm again")
            return
        missed = event.failed_rounds - failed
        if s.isolated is None and missed >= ISOLATED_AFTER_ROUNDS and event.swarm_size >= 2:
            why = {
                "client": "; it takes part as a client, and two clients cannot average with each other",
                "relayed": "; it is reached through the coordinator's relay",
            }.get(s.reachability or "", "")
            s.isolated = (
                f"has not averaged with anyone in its last {missed} rounds while {event.swarm_size - 1} other "
                f"peer(s) train: its work is not reaching the shared model{why}"
            )
            self.on_message(f"warning: this worker {s.isolated}")
            # the verdict of the last join may be stale (a laptop that moved behind a router, a firewall that
            # appeared): join again, and the coordinator dials this computer back anew; not more often than
            # reachability_recheck, and the restart itself happens in the background
            if self.clock.time() - self._reachability_checked >= self.settings.reachability_recheck:
                self._reachability_checked = self.clock.time()
                self._background(
                    self._restart("checking again how other peers reach this computer", rejoin=True)
                )

    def _evaluated(self, event: EvalEvent) -> None:
        self.status.eval_metrics = event.metrics
        request_id = getattr(event, "request_id", None)
        samples = [
            EvaluationSample.model_validate(sample if isinstance(sample, dict) else sample.model_dump())
            for sample in getattr(event, "samples", None) or []
        ]
        evaluation = Evaluation(
            request_id=request_id,
            at=self.clock.time(),
            epoch=event.epoch,
            metrics=event.metrics,
            samples=samples,
            peers_averaged=max(1, int(getattr(event, "peers_averaged", 1) or 1)),
        )
        self.last_evaluation = evaluation
        future = self._evaluations.get(request_id or "")
        if future is None and request_id is None and self._evaluations:  # a worker without request ids
            future = next(iter(self._evaluations.values()))
        if future is not None and not future.done():
            future.set_result(evaluation)
        shown = ", ".join(f"{k} {v:.3f}" for k, v in event.metrics.items())
        whose = (
            f" (the mean of {evaluation.peers_averaged} peers' models)"
            if evaluation.peers_averaged > 1
            else ""
        )
        self.on_message(f"evaluation at epoch {event.epoch}{whose}: {shown}")

    # ------------------------------------------------------------------ coordinator traffic
    async def _heartbeats(self, session_stop: asyncio.Event) -> None:
        assert self._join is not None
        attempt = 0
        interval = self._join.heartbeat_interval
        link = self._link_()
        while not session_stop.is_set():
            # until the (re)started worker reports, only the session's sample count is known
            figures = (
                TrainingFigures.of(self.status)
                if self._progress is not None
                else TrainingFigures(samples_total=self.status.samples_total)
            )
            report = HeartbeatRequest(state=heartbeat_state(self.status.state), **figures.figures())
            session = self._join.session_id
            try:
                answer = await link.once(
                    lambda session=session, report=report: link.client.heartbeat(session, report)  # type: ignore[misc]
                )
                attempt = 0
                interval = answer.next_heartbeat
                await self._apply_commands(answer.commands)
                assert self.leases is not None
                await self.leases.flush()
                paused_for = self.clock.time() - self._paused_since if self._paused_since is not None else 0.0
                if paused_for >= LONG_PAUSE_SECONDS and not self.status.finishing:
                    # a short pause keeps its leases (resuming goes straight on); a long one gives back what
                    # it can no longer finish in time, so that the shard is not stuck until it expires
                    await self.leases.return_due(
                        samples_per_second=self._usual_rate, margin=max(RETURN_MARGIN_SECONDS, 2 * interval)
                    )
            except CoordinatorUnreachable as exc:
                attempt += 1
                interval = backoff_delay(attempt, initial=2.0)
                self.status.last_error = str(exc)
                if attempt in (1, 5) or attempt % 20 == 0:
                    self.on_message(f"{exc}; training goes on, reports are kept and sent later")
            except CoordinatorRefused as exc:
                if exc.status == 429:
                    interval = exc.retry_after or interval
                else:
                    await self._refused(exc)
                    if self.stop_event.is_set() or self._rejoin:
                        return
            await self.clock.wait(session_stop, interval)

    async def _refused(self, exc: CoordinatorRefused) -> None:
        if exc.status == 429:
            return
        if exc.code in ("session_ended", "session_not_found"):
            self.on_message("the coordinator ended this session")
            self._rejoin = True
            return
        self.status.stop_reason = exc.detail
        self.on_message(f"the coordinator stopped this contribution: {exc.detail}")
        self.request_stop(exc.detail)

    async def _apply_commands(self, commands: list[Any]) -> None:
        assert self._join is not None
        for command in commands:
            if command.type == "pause":
                self._paused_by_organizers = True
                self.on_message(command.reason or "paused by the organizers")
                await self._apply_pause()
            elif command.type == "resume":
                self._paused_by_organizers = False
                self.on_message(command.reason or "resumed by the organizers")
                await self._apply_pause()
            elif command.type == "stop":
                self.on_message(command.reason or "the run has finished")
                self.request_stop(command.reason or "the run has finished")
            elif command.type == "new_token" and command.peer_token:
                self._join = self._join.model_copy(update={"peer_token": command.peer_token})
                await self._send(TokenCommand(peer_token=command.peer_token))

    async def _leave_session(self) -> None:
        if self._link is None or self._join is None:
            return
        session = self._join.session_id
        with contextlib.suppress(CoordinatorUnreachable, CoordinatorRefused, asyncio.TimeoutError):
            await asyncio.wait_for(self._link.client.leave(session), timeout=10)

    async def _shutdown(self) -> None:
        for worker in (self._worker, self._prestarted):
            if worker is not None:
                worker.kill()
        self._prestarted = None
        if self._link is not None:
            if self.leases is not None:
                with contextlib.suppress(CoordinatorUnreachable, CoordinatorRefused, asyncio.TimeoutError):
                    await asyncio.wait_for(self.leases.flush(), timeout=15)
            await self._leave_session()
            await self._link.client.aclose()
