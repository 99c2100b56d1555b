"""The collaborative training loop of one worker.

:class:`Trainer` composes parts that work alone, the way ``hivemind.Optimizer`` composes its averagers:

* the task runtime (model, data, loss, evaluation, drawing), built from the run's task config;
* :mod:`workers.fitting`: the micro-batch that fits this machine's memory;
* :class:`~workers.leases.LeaseFeeder`: leased shards as micro-batches;
* the run's DHT with its :class:`~workers.authorizer.PeerTokenAuthorizer`, and the collaborative
  optimizer of the run's update mode with the task's parameter groups and learning-rate schedule
  (:mod:`workers.collab`, :mod:`workers.optim`);
* :class:`~workers.commands.Controls`: the supervisor's commands (pause, resume, stop, token, lease,
  evaluate, limits), applied between micro-batches;
* :mod:`workers.reporting` and :mod:`workers.evaluation`: the events the supervisor reads.

Pausing stops the compute but not the peer: gradients it already accumulated are handed to hivemind
first, and while paused it still joins the swarm's averaging rounds with them, so no accumulated
sample is thrown away; resuming continues the same shard where it stopped.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from volunteer_app.protocol import PeerAssignment
from volunteer_app.tokens import VerifyingKeys
from volunteer_app.worker_protocol import (
    EXIT_RUN_REFUSED,
    AveragedEvent,
    ErrorEvent,
    EvaluateCommand,
    LeaseDoneEvent,
    NeedLeaseEvent,
    ProgressEvent,
    ReadyEvent,
    StateEvent,
    StoppedEvent,
    WorkerStart,
    WorkerStateName,
)
from workers.commands import Controls, read_commands
from workers.reporting import EventWriter, RateMeter, TrainingTally

__all__ = ["EventWriter", "RateMeter", "Trainer", "lower_helper_priority", "read_commands"]

logger = logging.getLogger(__name__)


DHT_START_TIMEOUT = 120.0
"""Seconds the DHT may take to start and reach the swarm's initial peers."""
EXIT_BROKEN_MODEL = 4
"""The worker's exit status when its model went NaN or infinite and no peer had a finite one."""


class Phases:
    """How long each start-up phase took, for the worker's log ("ready in 9.1 s: model 0.2 s, ...")."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.items: list[tuple[str, float]] = []

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.items.append((name, now - self._last))
        self._last = now

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.items)
        return f"{self._last - self.started:.1f} s: {parts}"


REVOCATION_POLL_SECONDS = 30.0
COMMAND_EVAL_MAX_SAMPLES = 128
"""Held-out samples an evaluate command's metrics use when it sets no cap (a second or two of pause)."""
FINAL_EVAL_PEERS = 3
"""Other peers whose parameters the evaluation before stopping averages with this peer's (each downloaded and
checked, at this peer's epoch): in ``tests/perf/bench_learning_swarm.py`` the mean of two real peers' models
beat one peer's own at 21 of 23 points from 40k samples on (+3.1 points of prompt accuracy on average)."""
FINAL_EVAL_TIMEOUT = 30.0
"""Seconds those downloads may take together (a peer that left is passed over at once); the agent waits up to
180 s for a worker that evaluates before it stops."""
DEFAULT_LOCAL_BATCH_SIZE = 32
"""Samples per local optimizer step when the task config does not say (``local_batch_size``)."""


class Trainer:
    """Trains one peer of a run until told to stop.

    :param start: the supervisor's start message (join answer, key path, limits).
    :param events: where events go (stdout of the worker process).
    :param commands: commands from the supervisor, already validated.
    """

    def __init__(self, *, start: WorkerStart, events: EventWriter, commands: queue.Queue[Any]):
        self.start = start
        self.events = events
        self.commands = commands
        self.join = start.join
        self.assignment: PeerAssignment = start.join.assignment
        self.state: WorkerStateName = "starting"
        self.controls = Controls(
            evaluate_on_stop=start.evaluate_on_stop,
            on_token=self._push_token,
            on_lease=self._add_lease,
            on_drop_lease=self._drop_lease,
        )
        self.tally = TrainingTally()
        self.rate = RateMeter()
        self.threads = max(1, self.assignment.threads)
        self.exit_code = 0
        self.skipped_micro_batches = 0

    # ------------------------------------------------------------------ helpers
    def set_state(self, state: WorkerStateName, detail: str | None = None) -> None:
        if state != self.state:
            self.state = state
            self.events.emit(StateEvent(state=state, detail=detail))

    def error(self, message: str, *, fatal: bool = False) -> None:
        logger.error(message)
        self.events.emit(ErrorEvent(message=message, fatal=fatal))

    def _device(self) -> Any:
        import torch

        if self.assignment.device == "cuda":
            if torch.cuda.is_available():
                return torch.device("cuda")
            self.error("the coordinator assigned a CUDA GPU but torch sees none; training on the CPU instead")
        return torch.device("cpu")

    def _autocast(self) -> Any:
        import torch

        device = getattr(self, "device", None)
        if device is not None and device.type == "cuda" and self.assignment.amp:
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return torch.autocast("cuda", dtype=dtype)
        return contextlib.nullcontext()

    def _push_token(self, token: str) -> None:
        from workers.authorizer import push_token

        try:
            push_token(self.dht, token)
        except Exception as exc:
            self.error(f"the coordinator sent a peer token this worker cannot use: {exc}")

    def _add_lease(self, lease: Any) -> None:
        self.feeder.add(lease)

    def _drop_lease(self, lease_id: str) -> None:
        dropped = self.feeder.drop(lease_id)
        if dropped is not None:
            logger.info("dropped lease %s after %d samples: the agent gave it back", lease_id, dropped)

    def _apply_threads(self) -> None:
        threads = self.controls.take_threads()
        if threads is not None and threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads
            logger.info("training with %d thread(s) now", threads)

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        import torch

        from workers.collab import ByteCounter, build_dht, count_received_bytes, make_authorizer
        from workers.identity import load_hivemind_key

        self.set_state("starting")
        self._phases = Phases()
        self.device = device = self._device()
        torch.set_num_threads(self.threads)
        run = self.join.run
        refusal = self._check_run(run, device)  # before anything is dialled, built or allocated
        if refusal is not None:
            self.error(f"refusing run {run.name}: {refusal}", fatal=True)
            return EXIT_RUN_REFUSED
        key = load_hivemind_key(Path(self.start.peer_key_path))
        self.keys = VerifyingKeys.from_records([k.model_dump() for k in self.join.coordinator_keys])
        authorizer = make_authorizer(
            run=run.name, keys=self.keys, token=self.join.peer_token, private_key=key
        )
        self.counter = ByteCounter()
        count_received_bytes(self.counter)
        swarm_error = f"cannot join the run's swarm at {', '.join(self.join.initial_peers) or '(no peers)'}"
        try:  # the DHT's process starts (p2pd, bootstrap) while this one builds the model
            self.dht = build_dht(
                initial_peers=list(self.join.initial_peers),
                authorizer=authorizer,
                host=self.start.listen_host,
                port=self.start.listen_port,
                announce_host=self.start.announce_host,
                client_mode=self.assignment.client_mode,
                reachability=self.assignment.reachability,
                await_ready=False,
            )
        except Exception as exc:
            self.error(f"{swarm_error}: {exc}", fatal=True)
            return 3
        try:
            return self._prepare_and_train(run, device, swarm_error)
        finally:
            with contextlib.suppress(Exception):
                self.dht.shutdown()

    def _check_run(self, run: Any, device: Any) -> str | None:
        """Check what the run asks of this machine, from the coordinator's answer, which is not trusted: its
        task must be installed (looked up by name), its files must be the agent's checked copies, and its
        model must fit the memory limit. Returns why the run is refused, or None (then ``spec``, ``config``
        and ``runtime`` are set)."""
        from workers import runfiles
        from workers.fitting import ModelTooBig, check_model_fits
        from workers.tasks import TaskConfigError, UnknownTaskError, load_task

        try:
            self.spec = spec = load_task(run.task)
            self.config = config = runfiles.task_config(
                spec, run.task_config, files=self.start.files, cache_dir=self.start.cache_dir
            )
            self.runtime = runtime = spec.build_runtime(config)
            check_model_fits(runtime, limit_bytes=self.start.memory_limit_bytes, device=device)
        except (UnknownTaskError, TaskConfigError, ModelTooBig) as exc:
            return str(exc)
        return None

    def _prepare_and_train(self, run: Any, device: Any, swarm_error: str) -> int:
        import torch

        from workers.fitting import fit_micro_batch
        from workers.leases import LeaseFeeder

        spec, config, runtime = self.spec, self.config, self.runtime
        torch.manual_seed(getattr(config, "seed", 0))
        self.model = model = runtime.build_model().to(device)
        parameters = sum(p.numel() for p in model.parameters())
        self._phases.done("model")
        if run.optimizer.update_mode == "gradients":
            per_step = self.assignment.micro_batch_size * max(1, self.assignment.accumulation_steps)
        else:  # a local step is a training hyperparameter: as many samples as the learning rate was tuned at
            per_step = int(getattr(config, "local_batch_size", DEFAULT_LOCAL_BATCH_SIZE))
        micro_batch, self.accumulation = fit_micro_batch(
            runtime=runtime,
            model=model,
            device=device,
            micro_batch=self.assignment.micro_batch_size,
            samples_per_step=max(per_step, 1),
            memory_cap=self.start.max_memory_bytes,
            autocast=self._autocast,
        )
        self._phases.done("micro-batch fit")
        self.feeder = LeaseFeeder(
            runtime=runtime, micro_batch_size=micro_batch, device=device, num_shards=spec.num_shards(config)
        )
        if self.join.lease is not None:
            self.feeder.add(self.join.lease)
        try:
            ready = self._await_swarm()
        except Exception as exc:
            self.error(f"{swarm_error}: {exc}", fatal=True)
            return 3
        if not ready:  # told to stop before the swarm answered: nothing was trained, nothing to hand over
            self.events.emit(
                StoppedEvent(samples_total=0, lease_id=None, lease_samples_done=0, compute_seconds=0.0)
            )
            return 0
        self._phases.done("swarm (DHT)")
        return self._train(parameters, micro_batch)

    def _await_swarm(self) -> bool:
        """Wait for the DHT to reach the swarm, still obeying the supervisor: True once it is ready, False
        when a stop came first (a swarm that is slow to answer must not make ``volunteer-app stop`` wait
        for the whole start timeout).

        :raises TimeoutError: when the swarm has not answered in :data:`DHT_START_TIMEOUT` seconds.
        """
        from concurrent.futures import TimeoutError as FutureTimeout

        deadline = time.monotonic() + DHT_START_TIMEOUT
        while True:
            self.controls.drain(self.commands)
            if self.controls.stopping:
                return False
            try:
                self.dht.wait_until_ready(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                return True
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer in {DHT_START_TIMEOUT:.0f} s") from None

    def _build_optimizer(self, micro_batch: int) -> Any:
        from workers.collab import build_optimizer
        from workers.optim import optimizer_parts

        run = self.join.run
        groups, optimizer_factory, scheduler_factory = optimizer_parts(
            self.runtime, self.model, self.config, samples_per_epoch=run.optimizer.samples_at_epoch
        )
        return build_optimizer(
            dht=self.dht,
            run_id=run.hivemind_run_id,
            params=groups,
            optimizer_factory=optimizer_factory,
            scheduler_factory=scheduler_factory,
            settings=run.optimizer,
            assignment=self.assignment.model_copy(update={"accumulation_steps": self.accumulation}),
            micro_batch_size=micro_batch,
            counter=self.counter,
        )

    def _train(self, parameters: int, micro_batch: int) -> int:
        from workers.robust import STATE_CHECK_SAMPLES, loss_probe

        maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        self.opt = self._build_optimizer(micro_batch)
        # a state that peers serve (joining, catching up) is checked against this model's loss on a fixed batch
        self.opt.state_averager.state_probe = loss_probe(
            self.runtime, self.model, samples=min(STATE_CHECK_SAMPLES, micro_batch)
        )
        self._phases.done("optimizer")
        loaded_epoch = self._load_initial_state()
        self._phases.done("state download")
        logger.info("ready in %s", self._phases)
        self.events.emit(
            ReadyEvent(
                peer_id=str(self.dht.peer_id),
                maddrs=maddrs,
                parameters=parameters,
                device=str(self.device),
                threads=self.threads,
                micro_batch_size=micro_batch,
                accumulation_steps=self.accumulation,
                client_mode=self.assignment.client_mode,
                loaded_state_epoch=loaded_epoch,
            )
        )
        self._start_revocation_poller()
        lower_helper_priority()
        # hivemind, torch and pydantic leave ~10^6 long-lived objects; freezing them keeps the garbage
        # collector's full passes, which the training loop would otherwise pay for, short.
        gc.collect()
        gc.freeze()
        try:
            self._loop()
        finally:
            self._finish()
        return self.exit_code

    def _load_initial_state(self) -> int | None:
        """Start from the swarm's current model: from the peers when the swarm is training, otherwise from
        whoever still shares state (the coordinator's checkpoint of a swarm that emptied). Returns the
        epoch loaded, or None when this peer starts from the initial weights."""
        opt = self.opt
        try:
            if opt.tracker.global_epoch > opt.local_epoch:
                self.set_state("syncing", "downloading the current model from peers")
                opt.load_state_from_peers()
            else:
                self.set_state("syncing")
                opt.state_averager.load_state_from_peers(timeout=60)
                opt.tracker.report_local_progress(local_epoch=opt.local_epoch, samples_accumulated=0)
                if not opt.client_mode:
                    opt.state_averager.state_sharing_priority = opt.local_epoch
        except Exception as exc:
            self.error(
                f"could not load the current state from peers ({exc}); starting from the initial weights"
            )
            return None
        return opt.local_epoch if opt.local_epoch > 0 else None

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        import torch

        from workers import compat

        scaler = None
        if self.device.type == "cuda" and self.assignment.amp and not torch.cuda.is_bf16_supported():
            import hivemind

            scaler = hivemind.GradScaler()
        controls = self.controls
        micro_count = 0
        acc_samples = 0
        last_epoch = self.opt.local_epoch
        last_bytes = self.counter.sent
        next_report = time.monotonic()
        asked_for_lease = False
        while True:
            controls.drain(self.commands)
            self._apply_threads()
            if controls.stopping:
                if acc_samples:
                    self._optimizer_step(acc_samples, scaler)
                    acc_samples = micro_count = 0
                break
            if controls.evaluations:
                self._evaluate(controls.evaluations.popleft())
            batch = None if controls.paused else self.feeder.next_batch()
            self._report_finished_leases()
            if batch is None:
                if acc_samples:
                    # hand what was accumulated to hivemind before idling, so that it is not lost
                    self._optimizer_step(acc_samples, scaler)
                    acc_samples = micro_count = 0
                idle: WorkerStateName = "paused" if controls.paused else "waiting"
                if self.state != idle:
                    self._report_progress()  # the last micro-batches' counts arrive before the new state
                self.set_state(idle)
                if controls.paused:
                    asked_for_lease = False  # ask again on resuming: the agent takes no lease while paused
                elif not asked_for_lease:
                    self.events.emit(NeedLeaseEvent(queued=self.feeder.queued))
                    asked_for_lease = True
                try:
                    compat.update_global_epoch(self.opt, scaler)
                except Exception as exc:
                    self.error(f"averaging while idle failed, continuing: {exc}")
                time.sleep(0.2)
            else:
                asked_for_lease = False
                self.set_state("training")
                started = time.perf_counter()
                with self._autocast():
                    loss = self.runtime.loss(self.model, batch)
                loss_value = float(loss.detach())
                n = self.runtime.batch_size_of(batch)
                if math.isfinite(loss_value):
                    scaled = loss / self.accumulation
                    if scaler is not None:
                        scaler.scale(scaled).backward()
                    else:
                        scaled.backward()
                    micro_count += 1
                    acc_samples += n
                    if micro_count % self.accumulation == 0:
                        self._optimizer_step(acc_samples, scaler)
                        acc_samples = 0
                    elapsed = time.perf_counter() - started
                    self.tally.add_micro_batch(n, elapsed, loss_value)
                    self.rate.add(n)
                else:  # not back-propagated: its gradients would poison the step
                    elapsed = time.perf_counter() - started
                    if not self._non_finite_loss(n):
                        break
                self.feeder.record(n, elapsed)
            if self.opt.local_epoch != last_epoch:
                if not self._ensure_finite_model():
                    break
                sent = self.counter.sent
                ok = self.tally.add_round(
                    sent_bytes=sent - last_bytes, swarm_size=compat.swarm_size(self.opt)
                )
                self.events.emit(
                    AveragedEvent(epoch=self.opt.local_epoch, group_bytes=sent - last_bytes, ok=ok)
                )
                last_epoch, last_bytes = self.opt.local_epoch, sent
            if time.monotonic() >= next_report:
                self._report_progress()
                next_report = time.monotonic() + self.start.report_interval

    def _non_finite_loss(self, samples: int) -> bool:
        """A micro-batch's loss was NaN or infinite: it is not back-propagated (its gradients would poison the
        step). When the model itself went non-finite the swarm's state is downloaded. Returns False when
        the worker cannot go on (said as a fatal error)."""
        self.skipped_micro_batches += 1
        if self.skipped_micro_batches == 1 or self.skipped_micro_batches % 100 == 0:
            self.error(
                f"a micro-batch of {samples} samples gave a non-finite loss and was skipped "
                f"({self.skipped_micro_batches} so far)"
            )
        return self._ensure_finite_model()

    def _ensure_finite_model(self) -> bool:
        """Check the model's parameters after an averaging round or a non-finite loss; when they hold NaN or
        infinity, replace them (and the optimizer's state) with the swarm's. Returns False, after a fatal
        error, when no peer could provide a finite state."""
        from workers.compat import tensors_finite

        if tensors_finite(p.detach() for p in self.model.parameters()):
            return True
        self.error("the model's parameters became NaN or infinite; downloading the swarm's current state")
        self.set_state("syncing", "replacing a broken model with the swarm's")
        try:
            self.opt.load_state_from_peers()
        except Exception as exc:
            logger.warning("could not download the swarm's state: %s", exc)
        if tensors_finite(p.detach() for p in self.model.parameters()):
            logger.info("the model is finite again (the swarm's state of epoch %d)", self.opt.local_epoch)
            return True
        self.exit_code = EXIT_BROKEN_MODEL
        self.error(
            "the model's parameters are NaN or infinite and no peer could provide a finite state; "
            "stopping this worker (it starts again from the swarm's state when the agent restarts it)",
            fatal=True,
        )
        return False

    def _optimizer_step(self, samples: int, scaler: Any) -> None:
        try:
            self.opt.step(batch_size=samples, grad_scaler=scaler)
        except Exception as exc:  # a failed round must not end the peer: hivemind proceeds locally
            self.error(f"optimizer step failed, continuing: {exc}")
        self.opt.zero_grad(set_to_none=True)

    def _report_finished_leases(self) -> None:
        for finished in self.feeder.take_finished():
            self.events.emit(
                LeaseDoneEvent(
                    lease_id=finished.lease_id,
                    samples=finished.samples,
                    compute_seconds=round(finished.compute_seconds, 3),
                    loss=self.tally.loss_ema,
                )
            )
            if self.feeder.queued < 2:
                self.events.emit(NeedLeaseEvent(queued=self.feeder.queued))

    def _report_progress(self) -> None:
        from workers import compat

        current = self.feeder.current
        tally = self.tally
        self.events.emit(
            ProgressEvent(
                state=self.state,
                samples_total=tally.samples_total,
                samples_per_second=round(self.rate.rate(), 2),
                loss=round(tally.loss_ema, 5) if tally.loss_ema is not None else None,
                local_epoch=self.opt.local_epoch,
                global_epoch=compat.global_epoch(self.opt),
                swarm_size=compat.swarm_size(self.opt),
                samples_accumulated=compat.samples_accumulated(self.opt),
                averaging_rounds=tally.averaging_rounds,
                failed_rounds=tally.failed_rounds,
                bytes_sent=self.counter.sent,
                bytes_received=self.counter.received,
                lease_id=current.lease_id if current is not None else None,
                lease_samples_done=self.feeder.samples_done if current is not None else 0,
                lease_samples=current.samples if current is not None else 0,
                compute_seconds=round(tally.compute_seconds, 3),
                threads=self.threads,
            )
        )

    def _start_revocation_poller(self) -> None:
        from workers.collab import refresh_revocations

        def poll() -> None:
            while not self.controls.stopping:
                try:
                    refresh_revocations(
                        self.dht,
                        run_id=self.join.run.hivemind_run_id,
                        run_name=self.join.run.name,
                        keys=self.keys,
                    )
                except Exception as exc:
                    logger.debug("could not read revocations: %s", exc)
                for _ in range(int(REVOCATION_POLL_SECONDS / 0.5)):
                    if self.controls.stopping:
                        return
                    time.sleep(0.5)

        threading.Thread(target=poll, name="revocations", daemon=True).start()

    # ------------------------------------------------------------------ evaluation and end
    def _evaluate(self, command: EvaluateCommand, *, final: bool = False, peers_averaged: int = 1) -> None:
        """Evaluate between micro-batches. Asked for by the supervisor, the metrics use at most
        ``COMMAND_EVAL_MAX_SAMPLES`` held-out samples unless the command says otherwise, so that training
        pauses for a moment only; the evaluation before stopping uses the start message's cap."""
        from workers.evaluation import evaluate

        max_samples = command.max_samples
        if max_samples is None and not final:
            max_samples = COMMAND_EVAL_MAX_SAMPLES
        try:
            event = evaluate(
                self.runtime,
                self.model,
                epoch=self.opt.local_epoch,
                max_samples=max_samples,
                prompts=command.prompts,
                metrics=command.metrics,
                request_id=command.request_id,
            )
        except Exception as exc:
            self.error(f"evaluation failed: {exc}")
            return
        event.peers_averaged = peers_averaged
        self.events.emit(event)

    def _finish(self) -> None:
        self.set_state("stopping")
        self._report_finished_leases()
        self._report_progress()
        if self.controls.evaluate_on_stop:
            with contextlib.suppress(Exception):
                self.opt.state_averager.step(wait_for_delayed_updates=True)
            others = 0
            try:  # the swarm's model, not this peer's drift from it since the last round
                others = self.opt.state_averager.average_with_peers(
                    FINAL_EVAL_PEERS, timeout=FINAL_EVAL_TIMEOUT, exclude=coordinator_peer_ids(self.join)
                )
            except Exception as exc:
                logger.warning("could not average with the other peers before the final evaluation: %s", exc)
            self._evaluate(
                EvaluateCommand(max_samples=self.start.evaluate_max_samples),
                final=True,
                peers_averaged=1 + others,
            )
        current = self.feeder.current
        done = self.feeder.samples_done if current is not None else 0
        for step in (self.opt.shutdown, self.dht.shutdown):
            try:
                step()
            except Exception as exc:
                logger.warning("shutdown: %s", exc)
        self.events.emit(
            StoppedEvent(
                samples_total=self.tally.samples_total,
                lease_id=current.lease_id if current is not None else None,
                lease_samples_done=done,
                compute_seconds=round(self.tally.compute_seconds, 3),
            )
        )
        self.set_state("stopped")


def coordinator_peer_ids(join: Any) -> set[str]:
    """The peer ids in the join answer's initial peers (``.../p2p/<id>``): the coordinator's swarm peer."""
    return {maddr.rsplit("/p2p/", 1)[1] for maddr in join.initial_peers if "/p2p/" in maddr}


HELPER_NICENESS = 10


def lower_helper_priority(niceness: int = HELPER_NICENESS) -> int:
    """Run hivemind's helper processes (DHT, averagers, p2pd) at a lower priority than the training loop.

    Most of the time the helpers only keep connections and timers alive, yet at equal priority the
    scheduler hands them a slice of the core the training loop needs; at a lower priority they still get
    the CPU they need for averaging bursts, a little later, while the loop keeps its core. Returns how
    many processes were reniced.
    """
    import psutil

    changed = 0
    for child in psutil.Process().children(recursive=True):
        try:
            child.nice(max(child.nice(), os.getpriority(os.PRIO_PROCESS, 0) + niceness))
            changed += 1
        except (psutil.Error, OSError):
            continue
    return changed
