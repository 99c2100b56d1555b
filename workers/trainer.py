"""The collaborative training loop of one worker.

:class:`Trainer` composes parts that work alone, the way ``hivemind.Optimizer`` composes its averagers:
the task runtime (model, data, loss), the :class:`~workers.leases.LeaseFeeder` (leased shards as
micro-batches), the run's DHT with its :class:`~workers.authorizer.PeerTokenAuthorizer`, the
collaborative optimizer from :mod:`workers.collab`, and an :class:`EventWriter` that reports to the
supervisor. Commands (pause, resume, stop, token, lease) arrive on a queue between micro-batches.

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
from collections.abc import Callable
from typing import Any, TextIO

from pydantic import BaseModel

from volunteer_app.protocol import PeerAssignment
from volunteer_app.tokens import VerifyingKeys
from volunteer_app.worker_protocol import (
    AveragedEvent,
    ErrorEvent,
    EvalEvent,
    EvaluateCommand,
    LeaseCommand,
    LeaseDoneEvent,
    NeedLeaseEvent,
    PauseCommand,
    ProgressEvent,
    ReadyEvent,
    ResumeCommand,
    StateEvent,
    StopCommand,
    StoppedEvent,
    TokenCommand,
    WorkerStart,
    WorkerStateName,
    encode,
)

logger = logging.getLogger(__name__)

REVOCATION_POLL_SECONDS = 30.0


class EventWriter:
    """Writes events as JSON lines; thread-safe. A closed pipe (the supervisor died) is not an error."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()
        self.broken = False

    def emit(self, event: BaseModel) -> None:
        line = encode(event)
        with self._lock:
            if self.broken:
                return
            try:
                self._stream.write(line)
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.broken = True


class RateMeter:
    """Samples per second over a sliding window of recent micro-batches."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._points: list[tuple[float, int]] = []

    def add(self, samples: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._points.append((now, samples))
        cutoff = now - self.window
        while len(self._points) > 2 and self._points[0][0] < cutoff:
            self._points.pop(0)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        points = [p for p in self._points if p[0] >= now - self.window]
        if len(points) < 2:
            return 0.0
        elapsed = points[-1][0] - points[0][0]
        return sum(s for _, s in points[1:]) / elapsed if elapsed > 0 else 0.0


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
        self.paused = False
        self.stopping = False
        self.evaluate_on_stop = start.evaluate_on_stop
        self.samples_total = 0
        self.compute_seconds = 0.0
        self.loss_ema: float | None = None
        self.rate = RateMeter()
        self.averaging_rounds = 0
        self.failed_rounds = 0
        self._pending_eval: EvaluateCommand | None = None

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

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        import torch

        from workers.collab import (
            ByteCounter,
            build_dht,
            count_received_bytes,
            make_authorizer,
        )
        from workers.identity import load_hivemind_key
        from workers.leases import LeaseFeeder
        from workers.tasks import load_task

        self.set_state("starting")
        device = self._device()
        threads = max(1, self.assignment.threads)
        torch.set_num_threads(threads)
        run = self.join.run
        spec = load_task(run.task)
        config = spec.make_config(run.task_config)
        runtime = spec.build_runtime(config)
        torch.manual_seed(getattr(config, "seed", 0))
        model = runtime.build_model().to(device)
        parameters = sum(p.numel() for p in model.parameters())
        micro_batch, accumulation = self._fit_micro_batch(runtime, model, device)
        self.feeder = LeaseFeeder(
            runtime=runtime, micro_batch_size=micro_batch, device=device, num_shards=spec.num_shards(config)
        )
        if self.join.lease is not None:
            self.feeder.add(self.join.lease)

        key = load_hivemind_key(self._key_path())
        self.keys = VerifyingKeys.from_records([k.model_dump() for k in self.join.coordinator_keys])
        authorizer = make_authorizer(
            run=run.name, keys=self.keys, token=self.join.peer_token, private_key=key
        )
        self.counter = ByteCounter()
        count_received_bytes(self.counter)
        try:
            self.dht = build_dht(
                initial_peers=list(self.join.initial_peers),
                authorizer=authorizer,
                host=self.start.listen_host,
                announce_host=self.start.announce_host,
                client_mode=self.assignment.client_mode,
            )
        except Exception as exc:
            self.error(
                f"cannot join the run's swarm at {', '.join(self.join.initial_peers) or '(no peers)'}: {exc}",
                fatal=True,
            )
            return 3
        try:
            return self._train(runtime, model, device, config, parameters, micro_batch, accumulation, threads)
        finally:
            with contextlib.suppress(Exception):
                self.dht.shutdown()

    def _train(
        self,
        runtime: Any,
        model: Any,
        device: Any,
        config: Any,
        parameters: int,
        micro_batch: int,
        accumulation: int,
        threads: int,
    ) -> int:
        import torch

        from workers.collab import build_optimizer

        run = self.join.run
        maddrs = [str(m) for m in self.dht.get_visible_maddrs()]

        def optimizer_factory(params: Any) -> torch.optim.Optimizer:
            make = getattr(runtime, "make_optimizer", None)
            if make is not None:
                return make(params)
            return torch.optim.AdamW(
                params, lr=getattr(config, "lr", 1e-3), weight_decay=getattr(config, "weight_decay", 0.0)
            )

        self.accumulation = accumulation
        self.opt = build_optimizer(
            dht=self.dht,
            run_id=run.hivemind_run_id,
            params=model.parameters(),
            optimizer_factory=optimizer_factory,
            settings=run.optimizer,
            assignment=self.assignment.model_copy(update={"accumulation_steps": accumulation}),
            micro_batch_size=micro_batch,
            counter=self.counter,
        )
        loaded_epoch = self._load_initial_state()
        self.events.emit(
            ReadyEvent(
                peer_id=str(self.dht.peer_id),
                maddrs=maddrs,
                parameters=parameters,
                device=str(device),
                threads=threads,
                micro_batch_size=micro_batch,
                accumulation_steps=accumulation,
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
            self._loop(runtime, model, device)
        finally:
            self._finish(runtime, model)
        return 0

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

    def _key_path(self) -> Any:
        from pathlib import Path

        return Path(self.start.peer_key_path)

    # ------------------------------------------------------------------ memory
    def _fit_micro_batch(self, runtime: Any, model: Any, device: Any) -> tuple[int, int]:
        """Shrink the assigned micro-batch until one training step fits the memory cap (GPU memory on CUDA,
        ``max_memory_bytes`` or free RAM on the CPU); keep samples per optimizer step by accumulating more."""
        import torch

        micro = max(1, self.assignment.micro_batch_size)
        accumulation = max(1, self.assignment.accumulation_steps)
        per_step = micro * accumulation
        cap = self.start.max_memory_bytes
        while True:
            try:
                peak = self._probe_step(runtime, model, device, micro)
            except torch.cuda.OutOfMemoryError:
                peak = math.inf
            limit = cap
            if device.type == "cpu":
                import psutil

                available = psutil.virtual_memory().available
                limit = min(cap, available) if cap else int(available * 0.8)
            if limit is None or peak <= limit or micro == 1:
                break
            micro = max(1, micro // 2)
            logger.info("micro-batch lowered to %d to fit in %.1f GiB", micro, (limit or 0) / 2**30)
        accumulation = max(1, per_step // micro)
        return micro, accumulation

    def _probe_step(self, runtime: Any, model: Any, device: Any, micro: int) -> float:
        """Memory after one forward+backward at ``micro`` samples: peak allocated bytes on CUDA, the whole
        process's resident memory on the CPU (what a memory cap limits)."""
        import psutil
        import torch

        batch = next(iter(runtime.shard_batches(0, batch_size=micro, seed=0, device=device)))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with self._autocast(device):
            loss = runtime.loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(device))
        return float(psutil.Process().memory_info().rss)

    def _autocast(self, device: Any) -> Any:
        import torch

        if device.type == "cuda" and self.assignment.amp:
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return torch.autocast("cuda", dtype=dtype)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ loop
    def _loop(self, runtime: Any, model: Any, device: Any) -> None:
        import torch

        scaler = None
        if device.type == "cuda" and self.assignment.amp and not torch.cuda.is_bf16_supported():
            import hivemind

            scaler = hivemind.GradScaler()
        micro_count = 0
        acc_samples = 0
        last_epoch = self.opt.local_epoch
        last_bytes = self.counter.sent
        next_report = time.monotonic()
        asked_for_lease = False
        while True:
            self._drain_commands()
            if self.stopping:
                if acc_samples:
                    self._optimizer_step(acc_samples, scaler)
                    acc_samples = micro_count = 0
                break
            if self._pending_eval is not None:
                self._evaluate(runtime, model, self._pending_eval.max_samples)
                self._pending_eval = None
            batch = None if self.paused else self.feeder.next_batch()
            self._report_finished_leases()
            if batch is None:
                if acc_samples:
                    # hand what was accumulated to hivemind before idling, so that it is not lost
                    self._optimizer_step(acc_samples, scaler)
                    acc_samples = micro_count = 0
                self.set_state("paused" if self.paused else "waiting")
                if not self.paused and not asked_for_lease:
                    self.events.emit(NeedLeaseEvent(queued=self.feeder.queued))
                    asked_for_lease = True
                self._idle_epoch_update(scaler)
                time.sleep(0.2)
            else:
                asked_for_lease = False
                self.set_state("training")
                started = time.perf_counter()
                with self._autocast(device):
                    loss = runtime.loss(model, batch)
                scaled = loss / self.accumulation
                if scaler is not None:
                    scaler.scale(scaled).backward()
                else:
                    scaled.backward()
                n = runtime.batch_size_of(batch)
                value = float(loss.detach())
                if math.isfinite(value):
                    self.loss_ema = value if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * value
                micro_count += 1
                acc_samples += n
                if micro_count % self.accumulation == 0:
                    self._optimizer_step(acc_samples, scaler)
                    acc_samples = 0
                elapsed = time.perf_counter() - started
                self.feeder.record(n, elapsed)
                self.samples_total += n
                self.compute_seconds += elapsed
                self.rate.add(n)
            if self.opt.local_epoch != last_epoch:
                sent = self.counter.sent
                ok = sent > last_bytes or self.opt.tracker.global_progress.num_peers <= 1
                if self.opt.tracker.global_progress.num_peers > 1:
                    if sent > last_bytes:
                        self.averaging_rounds += 1
                    else:
                        self.failed_rounds += 1
                self.events.emit(
                    AveragedEvent(epoch=self.opt.local_epoch, group_bytes=sent - last_bytes, ok=ok)
                )
                last_epoch, last_bytes = self.opt.local_epoch, sent
            if time.monotonic() >= next_report:
                self._report_progress()
                next_report = time.monotonic() + self.start.report_interval

    def _optimizer_step(self, samples: int, scaler: Any) -> None:
        try:
            self.opt.step(batch_size=samples, grad_scaler=scaler)
        except Exception as exc:  # a failed round must not end the peer: hivemind proceeds locally
            self.error(f"optimizer step failed, continuing: {exc}")
        self.opt.zero_grad(set_to_none=True)

    def _idle_epoch_update(self, scaler: Any) -> None:
        """While not computing, still take part in the swarm's epoch transition with the gradients this
        peer already accumulated (hivemind would otherwise count them and then never receive them)."""
        opt = self.opt
        try:
            opt.state_averager.step(apply_delayed_updates=True)
            if self._samples_accumulated() > 0 and opt.tracker.ready_to_update_epoch:
                opt._update_global_epoch(scaler)  # the same call hivemind makes at the end of step()
        except Exception as exc:
            self.error(f"averaging while idle failed, continuing: {exc}")

    def _samples_accumulated(self) -> int:
        """Samples this peer has contributed toward the swarm's current epoch."""
        if self.opt.grad_averager is not None:
            return int(self.opt.grad_averager.local_samples_accumulated)
        return int(self.opt.tracker.local_progress.samples_accumulated)  # local updates: no gradient averager

    def _report_finished_leases(self) -> None:
        for finished in self.feeder.take_finished():
            self.events.emit(
                LeaseDoneEvent(
                    lease_id=finished.lease_id,
                    samples=finished.samples,
                    compute_seconds=round(finished.compute_seconds, 3),
                    loss=self.loss_ema,
                )
            )
            if self.feeder.queued < 2:
                self.events.emit(NeedLeaseEvent(queued=self.feeder.queued))

    def _report_progress(self) -> None:
        tracker = self.opt.tracker
        current = self.feeder.current
        self.events.emit(
            ProgressEvent(
                state=self.state,
                samples_total=self.samples_total,
                samples_per_second=round(self.rate.rate(), 2),
                loss=round(self.loss_ema, 5) if self.loss_ema is not None else None,
                local_epoch=self.opt.local_epoch,
                global_epoch=tracker.global_epoch,
                swarm_size=tracker.global_progress.num_peers,
                samples_accumulated=self._samples_accumulated(),
                averaging_rounds=self.averaging_rounds,
                failed_rounds=self.failed_rounds,
                bytes_sent=self.counter.sent,
                bytes_received=self.counter.received,
                lease_id=current.lease_id if current is not None else None,
                lease_samples_done=self.feeder.samples_done if current is not None else 0,
                lease_samples=current.samples if current is not None else 0,
                compute_seconds=round(self.compute_seconds, 3),
            )
        )

    # ------------------------------------------------------------------ commands
    def _drain_commands(self) -> None:
        from workers.authorizer import push_token

        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, PauseCommand):
                self.paused = True
            elif isinstance(command, ResumeCommand):
                self.paused = False
            elif isinstance(command, StopCommand):
                self.stopping = True
                if command.evaluate is not None:
                    self.evaluate_on_stop = command.evaluate
            elif isinstance(command, TokenCommand):
                try:
                    push_token(self.dht, command.peer_token)
                except Exception as exc:
                    self.error(f"the coordinator sent a peer token this worker cannot use: {exc}")
            elif isinstance(command, LeaseCommand):
                self.feeder.add(command.lease)
            elif isinstance(command, EvaluateCommand):
                self._pending_eval = command
            elif command is None:  # stdin closed: the supervisor is gone, leave gracefully
                self.stopping = True

    def _start_revocation_poller(self) -> None:
        from workers.collab import refresh_revocations

        def poll() -> None:
            while not self.stopping:
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
                    if self.stopping:
                        return
                    time.sleep(0.5)

        threading.Thread(target=poll, name="revocations", daemon=True).start()

    # ------------------------------------------------------------------ end
    def _evaluate(self, runtime: Any, model: Any, max_samples: int | None) -> None:
        import torch

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                metrics = runtime.evaluate(model, max_samples=max_samples)
            self.events.emit(
                EvalEvent(metrics={k: float(v) for k, v in metrics.items()}, epoch=self.opt.local_epoch)
            )
        except Exception as exc:
            self.error(f"evaluation failed: {exc}")
        finally:
            model.train(was_training)

    def _finish(self, runtime: Any, model: Any) -> None:
        self.set_state("stopping")
        self._report_finished_leases()
        self._report_progress()
        if self.evaluate_on_stop:
            with contextlib.suppress(Exception):
                self.opt.state_averager.step(wait_for_delayed_updates=True)
            self._evaluate(runtime, model, self.start.evaluate_max_samples)
        current = self.feeder.current
        done = self.feeder.samples_done if current is not None else 0
        for step in (self.opt.shutdown, self.dht.shutdown):
            try:
                step()
            except Exception as exc:
                logger.warning("shutdown: %s", exc)
        self.events.emit(
            StoppedEvent(
                samples_total=self.samples_total,
                lease_id=current.lease_id if current is not None else None,
                lease_samples_done=done,
                compute_seconds=round(self.compute_seconds, 3),
            )
        )
        self.set_state("stopped")


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


def read_commands(stream: TextIO, commands: queue.Queue[Any], on_error: Callable[[str], None]) -> None:
    """Read command lines until EOF, then queue ``None`` (the supervisor closed the pipe)."""
    from pydantic import ValidationError

    from volunteer_app.worker_protocol import COMMANDS

    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            commands.put(COMMANDS.validate_json(line))
        except ValidationError as exc:
            on_error(f"ignoring a malformed command: {exc.errors()[0].get('msg', exc)}")
    commands.put(None)
