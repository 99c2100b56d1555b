"""``volunteer-app demo``: a whole swarm on this machine in one command.

It starts a coordinator on loopback with a temporary data directory (``volunteer-coordinator serve``
in a child process), creates a ``shapes-dalle`` run, then runs N agents exactly as volunteers run
them (each registers, profiles, joins, and trains in its own worker process with its own hivemind
peer), and shows them train together. At the end the first peer stops, averages its parameters with the
others' (downloaded from them while they still train: between two averaging rounds each peer's model
drifts from the swarm's by its own steps), evaluates that mean, the others stop, and a
summary is printed (``--json``: peers, samples, averaging rounds, loss at start and end, prompt
accuracy), followed by the model's drawings of the task's fixed showcase prompts: rendered in the
terminal with half-block characters (true colour where the terminal says it has it), and written as a
PNG grid whose path is printed (``drawings_png`` in ``--json``). The temporary directory is removed
afterwards unless ``--keep`` is given, or the demo failed (the error names the log to read in it).

Above the live panel the demo prints the peers' messages that matter: joins, worker start-up, evaluations,
errors, failed steps and restarts, flagged or refused leases. The routine line each credited lease gets
(two a second, hundreds in a run) is left out unless ``--verbose`` is given
(:func:`volunteer_app.display.is_routine`); every message, shown or not, goes to ``demo.log`` in the
temporary directory, and ``--json`` writes every one as a ``message`` event.

The run uses the coordinator's default optimizer settings (what an organizer gets with no options) and
the task's defaults, plus a learning-rate schedule that decays over the samples the demo expects to
train (``DEMO_SAMPLES_PER_SECOND_PER_CORE``), so a short demo ends on a settled model.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import psutil

from volunteer_app.agent.contribution import AgentError, Contribution
from volunteer_app.control import ContributionState
from volunteer_app.pictures import Picture, gallery_lines, grid, png_bytes
from volunteer_app.safetext import clean
from volunteer_app.settings import AgentSettings

RUN = "shapes-demo"
MESSAGES_LOG = "demo.log"
"""Every message of every peer, one timestamped line each, in the demo's data directory (kept with ``--keep``
or when the demo fails): the lines the screen leaves out without ``--verbose`` are here."""


class DemoError(Exception):
    pass


DEMO_SAMPLES_PER_SECOND_PER_CORE = {"mini": 220.0, "tiny": 95.0, "base": 17.0}
"""Samples a peer of each preset trains per second per core alone on a quiet core (tests/perf/
bench_task_speed.py x the swarm efficiency); sizes the learning-rate decay of the demo's run. Demo peers
train about that beside the coordinator (tests/perf/bench_demo.py, mini, 2 peers, 270 s: 114k samples,
about 210 per peer per second), so the schedule reaches its floor as the demo ends. (Before the worker
stopped waiting for averaging rounds and flooding the DHT, a demo peer trained half that, and the decay
was deliberately left unfinished: decaying over what it really trained ended worse.)"""


@dataclass
class DemoOptions:
    peers: int = 2
    duration: float = 270.0
    """Seconds of training: with start-up and the final evaluation the demo takes about 5 minutes."""
    samples: int | None = None
    """Stop once the peers have trained this many samples together (or at ``duration``, whichever comes first),
    and decay the learning rate over exactly them: the same model on a slow machine as on a fast one, only
    later. None: as many as ``duration`` allows."""
    json: bool = False
    keep: bool = False
    preset: str = "mini"
    """The model: ``mini``, the fastest preset (2x ``tiny``'s samples per second); what the default duration
    reaches on a 2-core machine is in the README's Performance table (docs/performance.md#the-5-minute-demo)."""
    target_batch_size: int | None = None
    """Samples per averaging round; None keeps the coordinator's default."""
    run_args: list[str] = field(default_factory=list)
    """More ``volunteer-coordinator runs create`` arguments for the demo's run, e.g. ``["--matchmaking-time",
    "1"]`` (``tests/perf/bench_demo.py --run-args``)."""
    threads: int | None = None
    data_dir: Path | None = None
    port: int = 0
    drawings_path: Path | None = None
    """Where the PNG of the final drawings goes (default: a new file in the system's temporary directory)."""
    headless: bool = False
    """Progress as a line every few seconds instead of a panel redrawn in place (logs, dumb terminals)."""
    verbose: bool = False
    """Every peer message on the screen, one line per credited lease included (always in :data:`MESSAGES_LOG`
    and in ``--json``)."""
    task_config: dict[str, str] = field(default_factory=dict)
    """Task config overrides for the demo's run (``runs create --config KEY=VALUE``), e.g. ``{"lr": "3e-3"}``
    for a benchmark of another learning rate (``tests/perf/bench_demo.py --config``)."""


@dataclass
class Drawing:
    """One showcase prompt as the final model drew it."""

    prompt: str
    correct: bool | None
    error: str | None
    picture: Picture | None


class Coordinator:
    """A ``volunteer-coordinator serve`` child process on loopback."""

    def __init__(self, data_dir: Path, port: int):
        self.data_dir = data_dir
        self.port = port
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.log_path = data_dir / "serve.log"

    def _cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "coordinator.cli", *args],
            capture_output=True,
            text=True,
            env=self._env(),
            check=False,
        )

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL", "2")
        env.setdefault("VOLUNTEER_COORDINATOR_SWARM__CHECKPOINT_INTERVAL", "20")
        env.setdefault("VOLUNTEER_COORDINATOR_LIMITS__REGISTER_PER_MINUTE", "600")
        env.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
        return env

    def create_run(
        self,
        *,
        preset: str,
        target_batch_size: int | None,
        expected_samples: int,
        run_args: list[str] | None = None,
        task_config: dict[str, str] | None = None,
    ) -> None:
        extra = [] if target_batch_size is None else ["--target-batch-size", str(target_batch_size)]
        extra += run_args or []
        overrides = [
            item for key, value in (task_config or {}).items() for item in ("--config", f"{key}={value}")
        ]
        result = self._cli(
            "runs", "create", "--data-dir", str(self.data_dir), "--name", RUN, "--task", "shapes-dalle",
            "--preset", preset, "--description", "the volunteer-app demo run", *extra,
            # The run's optimizer settings are the coordinator's defaults; the schedule decays over what the
            # demo will train, so that the model has settled when the summary draws with it.
            "--config", f"decay_samples={expected_samples}", *overrides,
        )  # fmt: skip
        if result.returncode != 0:
            raise DemoError(f"could not create the demo run: {result.stderr.strip()}")

    def start(self, timeout: float = 60.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 - the child writes to it until stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", "--data-dir", str(self.data_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=self._env(), start_new_session=True,
        )  # fmt: skip
        log.close()
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.5)
            if ready:
                line = self.process.stdout.readline()
                if "serving at " in line:
                    self.url = line.split("serving at ", 1)[1].split()[0]
                    return self.url
            if self.process.poll() is not None:
                break
        raise DemoError(f"the coordinator did not start; see {self.log_path}")

    def wait_for_swarm(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if httpx.get(f"{self.url}/api/v1/runs/{RUN}", timeout=5).json()["initial_peers"]:
                    return
            time.sleep(0.5)
        raise DemoError(
            f"the run's swarm peer did not come up; see {self.data_dir / 'swarm' / (RUN + '.log')}"
        )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            self.process.kill()


def planned_samples(options: DemoOptions) -> int:
    """The samples the demo's peers are expected to train (``options.samples``, or what they train in
    ``options.duration`` at :data:`DEMO_SAMPLES_PER_SECOND_PER_CORE`): its run's learning-rate decay spans them
    (``decay_samples``), so that the model has settled when the summary draws with it."""
    if options.samples is not None:
        return options.samples
    threads = _threads_per_peer(options.peers, options.threads)
    rate = DEMO_SAMPLES_PER_SECOND_PER_CORE.get(options.preset, DEMO_SAMPLES_PER_SECOND_PER_CORE["tiny"])
    return max(1, int(options.duration * options.peers * threads * rate))


def _threads_per_peer(peers: int, requested: int | None) -> int:
    if requested:
        return requested
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    return max(1, cores // peers)


def _messenger(out: Any, who: str, log: TextIO | None = None) -> Callable[[str], None]:
    """What peer ``who``'s agent says: every line into ``log``, then to ``out`` (which may leave routine ones
    out, see :class:`volunteer_app.display.LiveDisplay`)."""

    def say(text: str) -> None:
        if log is not None:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {who} {clean(text)}\n")
            log.flush()
        out.message(text, who=who)

    return say


async def _run_agents(
    options: DemoOptions, url: str, root: Path, out: Any, agents: list[Any]
) -> list[ContributionState]:
    """Run the demo's agents until they stop, every message of theirs kept in :data:`MESSAGES_LOG`."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / MESSAGES_LOG, "a", encoding="utf-8") as log:
        return await _train_together(options, url, root, out, agents, log)


async def _train_together(
    options: DemoOptions, url: str, root: Path, out: Any, agents: list[Any], log: TextIO
) -> list[ContributionState]:
    threads = _threads_per_peer(options.peers, options.threads)
    for i in range(options.peers):
        settings = AgentSettings(
            config_dir=root / f"peer-{i}",
            max_threads=threads,
            listen_host="127.0.0.1",
            benchmark_seconds=2.0,
            device="auto",
        )
        name = f"peer-{i}"
        agents.append(
            Contribution(
                settings=settings,
                coordinator=url,
                run=RUN,
                name=name,
                # the others train on until the first has evaluated: its final model is the mean of its
                # parameters and theirs, which it downloads from them before it evaluates
                duration=options.duration if i == 0 and math.isfinite(options.duration) else None,
                evaluate_on_stop=i == 0,
                on_message=_messenger(out, name, log),
            )
        )
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for agent in agents:
            agent.request_stop("interrupted")

    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, stop_all)
        loop.add_signal_handler(signal.SIGTERM, stop_all)
    tasks = [asyncio.create_task(agent.run()) for agent in agents]
    others_stopped = False
    while not all(t.done() for t in tasks):
        trained = sum(a.status.samples_total for a in agents)
        if options.samples is not None and trained >= options.samples:
            agents[0].request_stop(f"the peers trained the requested {options.samples:,} samples")
        if tasks[0].done() and not others_stopped:
            others_stopped = True
            for agent in agents[1:]:
                agent.request_stop("the first peer evaluated the swarm's final model")
        statuses = [a.status for a in agents]
        footer = f"coordinator {url}  ·  dashboard {url}/dashboard/  ·  Ctrl-C stops"
        if hasattr(out, "update"):
            out.update(statuses, footer)
        else:
            out.status(statuses)
        await asyncio.sleep(0.5)
    errors = []
    for agent, task in zip(agents, tasks, strict=True):
        exc = task.exception()
        if isinstance(exc, AgentError):
            errors.append(f"{agent.name}: {exc}")
        elif exc is not None:
            raise exc
    if errors:
        raise DemoError("; ".join(errors))
    return [a.status for a in agents]


def _drawing(sample: Any) -> Drawing:
    """A Drawing from an evaluation sample (a pydantic model or its JSON form)."""
    data = sample if isinstance(sample, dict) else sample.model_dump(mode="json")
    picture = None
    image = data.get("image")
    if isinstance(image, dict):
        try:
            picture = Picture(int(image["width"]), int(image["height"]), base64.b64decode(image["pixels"]))
        except (KeyError, ValueError, TypeError):
            picture = None
    return Drawing(str(data.get("prompt", "")), data.get("correct"), data.get("error"), picture)


def final_drawings(agents: list[Any], checkpoints: Path) -> tuple[list[Drawing], str]:
    """The showcase drawings of the final model and where they come from.

    The first peer evaluates the shared model before it stops; when its agent keeps that evaluation
    (``last_evaluation``), its drawings are used. Otherwise those of the newest intact checkpoint that the
    coordinator's swarm peer saved (every few seconds in the demo) are read from its manifest.
    """
    for agent in agents:
        evaluation: Any = getattr(agent, "last_evaluation", None)
        samples = getattr(evaluation, "samples", None)
        if samples:
            peers = int(getattr(evaluation, "peers_averaged", 1) or 1)
            whose = f", the mean of {peers} peers' parameters" if peers > 1 else ""
            return [_drawing(s) for s in samples], f"the final model (epoch {evaluation.epoch}{whose})"
    newest = None
    if checkpoints.is_dir():
        for entry in sorted(checkpoints.iterdir(), reverse=True):
            manifest = entry / "manifest.json"
            if entry.name.startswith("epoch-") and manifest.is_file() and _intact(entry, manifest):
                newest = entry, json.loads(manifest.read_text())
                break
    if newest is None:
        return [], "no drawing (the swarm saved no checkpoint)"
    entry, data = newest
    drawings = [_drawing(p) for p in data.get("prompts") or [] if isinstance(p, dict)]
    return drawings, f"the swarm's last checkpoint (epoch {data.get('epoch')})"


def _intact(entry: Path, manifest: Path) -> bool:
    try:
        files = json.loads(manifest.read_text()).get("files") or {}
        return all(
            hashlib.sha256((entry / name).read_bytes()).hexdigest() == meta.get("sha256")
            for name, meta in files.items()
        )
    except (OSError, ValueError, AttributeError):
        return False


def write_drawings_png(drawings: list[Drawing], path: Path) -> Path | None:
    """The drawings as one PNG grid (4 per row, magnified 4x); None when there is nothing to draw."""
    pictures = [d.picture for d in drawings if d.picture is not None]
    if not pictures:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(grid(pictures, columns=4, pad=1, background=(90, 90, 90)), scale=4))
    return path


def summarize(statuses: list[ContributionState], coordinator_url: str, seconds: float) -> dict[str, Any]:
    evaluated = next((s.eval_metrics for s in statuses if s.eval_metrics), {})
    losses_start = [s.first_loss for s in statuses if s.first_loss is not None]
    losses_end = [s.loss for s in statuses if s.loss is not None]
    return {
        "peers": len(statuses),
        "seconds": round(seconds, 1),
        "samples": sum(s.samples_total for s in statuses),
        "samples_credited": sum(s.samples_credited for s in statuses),
        "samples_per_second": round(sum(s.samples_total for s in statuses) / max(1.0, seconds), 1),
        "averaging_rounds": max((s.averaging_rounds for s in statuses), default=0),
        "failed_rounds": max((s.failed_rounds for s in statuses), default=0),
        "global_epoch": max((s.global_epoch for s in statuses), default=0),
        "loss_start": round(sum(losses_start) / len(losses_start), 4) if losses_start else None,
        "loss_end": round(sum(losses_end) / len(losses_end), 4) if losses_end else None,
        "eval_loss": evaluated.get("loss"),
        "prompt_accuracy": evaluated.get("prompt_accuracy"),
        "bytes_sent": sum(s.bytes_sent for s in statuses),
        "coordinator": coordinator_url,
    }


def run_demo(options: DemoOptions) -> dict[str, Any]:
    from volunteer_app.display import JsonLines, LiveDisplay

    if options.peers < 1:
        raise DemoError("--peers must be at least 1")
    if options.duration <= 0:
        raise DemoError("--duration must be positive")
    if options.samples is not None and options.samples <= 0:
        raise DemoError("--samples must be positive")
    root = options.data_dir or Path(tempfile.mkdtemp(prefix="volunteer-demo-"))
    failed = False
    coordinator = Coordinator(root / "coordinator", options.port)
    out: Any = (
        JsonLines()
        if options.json
        else LiveDisplay(
            f"volunteer-app demo · {options.peers} peers · shapes-dalle ({options.preset})",
            plain=options.headless,
            verbose=options.verbose,
        )
    )
    started = time.monotonic()
    png_path = options.drawings_path or Path(tempfile.gettempdir()) / (
        f"volunteer-demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.png"
    )
    try:
        out.message(f"starting a coordinator on loopback (data in {root})")
        coordinator.create_run(
            preset=options.preset,
            target_batch_size=options.target_batch_size,
            run_args=options.run_args,
            expected_samples=planned_samples(options),
            task_config=options.task_config,
        )
        url = coordinator.start()
        coordinator.wait_for_swarm()
        out.message(f"coordinator ready at {url}; dashboard at {url}/dashboard/")
        agents: list[Any] = []
        if options.json:
            statuses = asyncio.run(_run_agents(options, url, root, out, agents))
        else:
            with out:
                statuses = asyncio.run(_run_agents(options, url, root, out, agents))
        summary = summarize(statuses, url, time.monotonic() - started)
        coordinator.stop()  # its swarm peer writes no checkpoint after this
        drawings, source = final_drawings(agents, coordinator.data_dir / "checkpoints" / RUN)
    except DemoError as exc:
        failed = True  # the logs the message points to stay, whatever --keep says
        raise DemoError(f"{exc} (the demo's files are kept in {root})") from exc
    finally:
        coordinator.stop()
        if not options.keep and options.data_dir is None and not failed:
            shutil.rmtree(root, ignore_errors=True)
    written = write_drawings_png(drawings, png_path)
    summary["drawings_png"] = str(written) if written is not None else None
    summary["drawings_from"] = source
    summary["drawings"] = [{"prompt": d.prompt, "correct": d.correct, "error": d.error} for d in drawings]
    judged = [d.correct for d in drawings if d.correct is not None]
    summary["drawings_correct"] = f"{sum(judged)}/{len(judged)}" if judged else None
    if options.json:
        out.emit("summary", **summary)
    else:
        print_summary(summary)
        print_drawings(drawings, summary)
    return summary


def print_drawings(drawings: list[Drawing], summary: dict[str, Any]) -> None:
    """The drawings under the summary: half blocks in the terminal, then the PNG's path."""
    pictures = [d for d in drawings if d.picture is not None]
    if pictures and sys.stdout.isatty():
        truecolor = os.environ.get("COLORTERM", "").lower() in ("truecolor", "24bit")
        captions = [
            f"{'✓' if d.correct else '✗' if d.correct is False else '·'} {d.prompt}" for d in pictures
        ]
        width = shutil.get_terminal_size((100, 40)).columns
        print(f"\nwhat the swarm's model draws now ({summary['drawings_from']}; ✓ = the checker agrees):\n")
        for line in gallery_lines(
            [d.picture for d in pictures if d.picture is not None], captions, width=width, truecolor=truecolor
        ):
            print(line)
    elif drawings:
        print(f"\ndrawings by {summary['drawings_from']}: {summary['drawings_correct']} right")
    if summary.get("drawings_png"):
        print(f"drawings: {summary['drawings_png']}")


def _loss_range(start: float | None, end: float | None) -> str | None:
    if start is None or end is None:
        return None
    return f"{start:.3f} → {end:.3f}"


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="demo summary", show_header=False)
    rows = [
        ("peers", summary["peers"]),
        ("samples trained", f"{summary['samples']} in {summary['seconds']:.0f} s, start-up included"),
        ("samples credited", summary["samples_credited"]),
        ("averaging rounds", summary["averaging_rounds"]),
        ("loss", _loss_range(summary["loss_start"], summary["loss_end"])),
        ("held-out loss", None if summary["eval_loss"] is None else round(summary["eval_loss"], 3)),
        (
            "prompt accuracy",
            None if summary["prompt_accuracy"] is None else f"{summary['prompt_accuracy']:.1%}",
        ),
        ("showcase prompts drawn right", summary.get("drawings_correct")),
    ]
    for key, value in rows:
        table.add_row(key, "-" if value is None else str(value))
    Console().print(table)
