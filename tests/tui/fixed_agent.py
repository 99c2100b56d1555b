"""A recorded agent for the snapshot tests: the real control protocol (pydantic messages from
``volunteer_app.control`` over a real websocket on loopback) serving one fixed state, plus the
coordinator's live leaderboard feed and overall leaderboard with fixed entries.

Snapshots need the same screen every time, which a training swarm never gives (numbers, times and
drawings change). The pilot tests in ``test_app_swarm.py`` drive the app against the real agent,
coordinator and worker; this fixture only pins down what is drawn.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from volunteer_app.control import (
    COMMANDS,
    AgentState,
    ContributionState,
    ErrorMessage,
    Evaluation,
    EvaluationSample,
    LogEntry,
    MetricPoint,
    PolicyDecision,
    PolicySettings,
    ResultMessage,
    SensorReadings,
    SnapshotMessage,
)
from volunteer_app.control_client import AgentAddress
from volunteer_app.protocol import GpuInfo, HardwareProfile, TaskBenchmark

NOW = 1_790_000_000.0  # the clock of every snapshot
TOKEN = "snapshot-token-" + "x" * 32

COLOURS = {
    "red": (220, 50, 47),
    "blue": (38, 139, 210),
    "green": (60, 190, 80),
    "yellow": (230, 200, 40),
    "white": (240, 240, 240),
    "orange": (240, 140, 30),
    "purple": (150, 80, 200),
    "cyan": (40, 200, 200),
}
PROMPTS: list[tuple[str, list[tuple[str, str, float, float, float]], bool]] = [
    # (caption, [(shape, colour, centre x, centre y, radius)], judged correct)
    ("a big red circle in the center", [("circle", "red", 16, 16, 10)], True),
    ("a small blue square at the top left", [("square", "blue", 7, 7, 4)], True),
    ("a large green triangle in the bottom right corner", [("triangle", "green", 22, 22, 9)], True),
    ("a big yellow diamond on the left", [("diamond", "yellow", 9, 16, 8)], False),
    (
        "a small white circle at the top and a large orange square at the bottom",
        [("circle", "white", 16, 6, 4), ("square", "orange", 16, 23, 8)],
        True,
    ),
    (
        "a big purple triangle at the top right and a small cyan diamond at the bottom left",
        [("triangle", "purple", 22, 9, 8), ("diamond", "cyan", 8, 24, 4)],
        False,
    ),
    ("a little green square on the right", [("square", "green", 25, 16, 4)], True),
    (
        "a large blue circle at the bottom and a small red triangle in the upper left corner",
        [("circle", "blue", 16, 22, 8), ("triangle", "red", 7, 7, 4)],
        False,
    ),
]


def inside(shape: str, x: float, y: float, cx: float, cy: float, r: float) -> bool:
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return abs(dx) <= r and abs(dy) <= r
    if shape == "diamond":
        return abs(dx) + abs(dy) <= r
    return -r <= dy <= r and abs(dx) <= (dy + r) / 2  # triangle, apex up


def drawing(shapes: list[tuple[str, str, float, float, float]], size: int = 32) -> dict[str, Any]:
    """A 32x32 picture of the shapes on a dark background, as the worker's ``EvalImage`` sends it."""
    pixels = bytearray()
    for y in range(size):
        for x in range(size):
            colour = (18, 18, 24)
            for shape, name, cx, cy, r in shapes:
                if inside(shape, x + 0.5, y + 0.5, cx, cy, r):
                    colour = COLOURS[name]
            pixels.extend(colour)
    return {"width": size, "height": size, "pixels": base64.b64encode(bytes(pixels)).decode()}


def evaluation() -> Evaluation:
    samples = [
        EvaluationSample(prompt=caption, kind="image", image=drawing(shapes), correct=correct)
        for caption, shapes, correct in PROMPTS
    ]
    return Evaluation(
        at=NOW - 95,
        epoch=41,
        metrics={"loss": 0.412, "prompt_accuracy": 0.625, "object_accuracy": 0.8},
        samples=samples,
    )


def metric_history() -> list[MetricPoint]:
    points = []
    for i in range(12):
        accuracy = min(0.625, max(0.0, (i - 2) * 0.07))
        points.append(
            MetricPoint(
                at=NOW - 600 * (12 - i),
                epoch=i * 4,
                samples=8000 * (i + 1),
                metrics={"loss": 3.0 - i * 0.22, "prompt_accuracy": accuracy},
            )
        )
    return points


def profile(*, gpu: bool) -> HardwareProfile:
    return HardwareProfile(
        cpu_model="AMD Ryzen 7 5800X 8-Core Processor",
        cpu_cores=8,
        cpu_threads=16,
        ram_bytes=32 * 2**30,
        os="Linux 6.1 (Debian 12)",
        python="3.11.7",
        torch="2.3.0",
        gpus=[
            GpuInfo(
                name="NVIDIA GeForce RTX 3060",
                memory_bytes=12 * 2**30,
                driver="550.54",
                cuda_capability="8.6",
            )
        ]
        if gpu
        else [],
        accepts_connections=True,
        benchmark=TaskBenchmark(
            task="shapes-dalle",
            preset="tiny",
            device="cuda" if gpu else "cpu",
            threads=8,
            micro_batch_size=64 if gpu else 16,
            samples_per_second=1840.0 if gpu else 212.5,
        ),
    )


def contribution(**changes: Any) -> ContributionState:
    values: dict[str, Any] = {
        "coordinator": "https://train.example.org",
        "run": "shapes",
        "name": "ada",
        "state": "training",
        "session_id": "5f0c2a9e",
        "task": "shapes-dalle",
        "samples_total": 96_512,
        "samples_per_second": 212.4,
        "loss": 0.412,
        "first_loss": 6.923,
        "local_epoch": 41,
        "global_epoch": 41,
        "swarm_size": 5,
        "averaging_rounds": 37,
        "bytes_sent": 183_500_000,
        "bytes_received": 191_200_000,
        "lease_id": "c0ffee11",
        "lease_shard": 1377,
        "lease_samples_done": 40,
        "lease_samples": 64,
        "leases_in_hand": 2,
        "leases_completed": 1490,
        "samples_credited": 95_360,
        "compute_seconds": 9_120.0,
        "device": "cpu",
        "threads": 8,
        "micro_batch_size": 16,
        "parameters": 1_079_080,
        "started_at": NOW - 9_300,
    }
    values.update(changes)
    return ContributionState(**values)


def agent_state(*, joined: bool = True, gpu: bool = False, **changes: Any) -> AgentState:
    values: dict[str, Any] = {
        "agent_version": "0.1.0",
        "pid": 4242,
        "started_at": NOW - 9_400,
        "state": "contributing" if joined else "idle",
        "config_dir": "/home/ada/.config/volunteer-app",
        "coordinator": "https://train.example.org" if joined else None,
        "run": "shapes" if joined else None,
        "name": "ada" if joined else None,
        "settings": PolicySettings(
            max_threads=8, pause_on_battery=True, schedule=["mon-fri 18:00-08:00", "sat,sun all"]
        ),
        "policy": PolicyDecision(notes=["battery: none found (a desktop, or not reported)"]),
        "sensors": SensorReadings(
            at=NOW - 3,
            cpu_percent=61.0,
            volunteer_cpu_percent=50.0,
            cpu_temp_c=64.0,
            gpu_temps_c=[58.0] if gpu else [],
            gpu_readable=gpu,
        ),
        "profile": profile(gpu=gpu),
        "contribution": contribution() if joined else None,
        "evaluation": evaluation() if joined else None,
        "metric_history": metric_history() if joined else [],
    }
    values.update(changes)
    return AgentState(**values)


def progress(count: int = 40) -> list[ContributionState]:
    """What the app saw of the contribution over the last minutes (the charts' points): samples/s
    settling around 212, the loss falling."""
    points = []
    for i in range(count):
        points.append(
            contribution(
                samples_total=96_512 - (count - 1 - i) * 640,
                samples_per_second=round(205 + 8 * math.sin(i / 4) + i * 0.2, 1),
                loss=round(0.412 + 0.5 * math.exp(-i / 9), 3),
            )
        )
    return points


LOG = [
    LogEntry(
        at=NOW - 9_390, message="agent 0.1.0 started (pid 4242); config in /home/ada/.config/volunteer-app"
    ),
    LogEntry(
        at=NOW - 9_380,
        message="registered as ada; the credential is in /home/ada/.config/volunteer-app/credentials.json",
    ),
    LogEntry(at=NOW - 9_370, message="this machine trains shapes-dalle at 212 samples/s"),
    LogEntry(
        at=NOW - 9_360,
        message="joined run shapes as ada (session 5f0c2a9e): cpu, 8 thread(s), micro-batch 16",
    ),
    LogEntry(at=NOW - 9_350, source="worker", message="worker ready: 1.08M parameters on cpu"),
    LogEntry(
        at=NOW - 4_000, level="warning", source="policy", message="pausing: the CPU is at 91 °C (limit 90 °C)"
    ),
    LogEntry(at=NOW - 3_700, source="policy", message="computing again"),
    LogEntry(
        at=NOW - 1_200,
        level="warning",
        message="the coordinator did not answer (timed out); reports wait in the outbox",
    ),
    LogEntry(at=NOW - 1_140, message="the coordinator answers again; sent 3 waiting reports"),
    LogEntry(at=NOW - 95, message="evaluation at epoch 41: loss 0.412, prompt_accuracy 0.625"),
    LogEntry(at=NOW - 40, message="lease 7d2e91aa credited: 64 samples"),
    LogEntry(at=NOW - 12, message="lease c0ffee10 credited: 64 samples"),
]

RUN = {
    "name": "shapes",
    "task": "shapes-dalle",
    "description": "A small DALL-E that draws coloured shapes",
    "state": "active",
    "visibility": "open",
    "created_at": NOW - 86_400,
    "data_epochs": 1,
    "task_config": {"preset": "tiny"},
    "optimizer": {},
    "stats": {
        "active_peers": 5,
        "samples_total": 512_640,
        "samples_credited": 498_112,
        "samples_verified": 480_000,
        "samples_per_second": 1_020.5,
        "loss": 0.44,
        "global_epoch": 41,
        "shards_done": 7_512,
        "shards_total": 16_384,
        "data_epoch": 0,
        "volunteers": 7,
    },
}


def entry(
    rank: int, name: str, samples: int, hours: float, speed: float, seen: float | None, online: bool
) -> dict[str, Any]:
    return {
        "rank": rank,
        "volunteer": name,
        "samples": samples,
        "verified_samples": int(samples * 0.97),
        "pending_samples": 0,
        "unverified_samples": int(samples * 0.03),
        "compute_seconds": hours * 3600,
        "samples_per_second": speed,
        "last_seen": seen,
        "devices": ["cpu"],
        "flagged": 0,
        "online": online,
    }


BOARD = [
    entry(1, "grace", 161_344, 3.1, 402.0, NOW - 4, True),
    entry(2, "linus", 120_000, 5.9, 0.0, NOW - 7_300, False),
    entry(3, "ada", 95_360, 2.53, 212.4, NOW - 2, True),
    entry(4, "barbara", 70_016, 1.2, 198.0, NOW - 9, True),
    entry(5, "edsger", 31_744, 0.8, 0.0, NOW - 90_000, False),
    entry(6, "margaret", 12_288, 0.4, 120.3, NOW - 1, True),
    entry(7, "ken", 7_360, 0.2, 88.0, NOW - 5, True),
]
OVERALL = [
    entry(1, "grace", 1_261_344, 31.1, 402.0, NOW - 4, True),
    entry(2, "ada", 895_360, 22.5, 212.4, NOW - 2, True),
    entry(3, "linus", 720_000, 25.9, 0.0, NOW - 7_300, False),
]


@dataclass
class FixedAgent:
    """Serves ``state`` to every app that attaches; answers commands with ``answers`` (or "done")."""

    state: AgentState
    log: list[LogEntry] = field(default_factory=lambda: list(LOG))
    answers: dict[str, ResultMessage | ErrorMessage] = field(default_factory=dict)
    board: list[dict[str, Any]] = field(default_factory=lambda: list(BOARD))
    commands: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None

    @property
    def address(self) -> AgentAddress:
        return AgentAddress(url=self.url, token=TOKEN, pid=self.state.pid)

    def route(self, coordinator: str) -> str:
        """The app reaches the state's coordinator (https://train.example.org) at this server."""
        return self.url

    async def _handle(self, connection: Any) -> None:
        path = connection.request.path
        if path == "/api/v1/ws":
            await connection.send(SnapshotMessage(state=self.state, log=self.log).model_dump_json())
            async for raw in connection:
                data = json.loads(raw)
                self.commands.append(data)
                command = COMMANDS.validate_python(data)
                answer = self.answers.get(command.command, ResultMessage(message=f"{command.command}: done"))
                await connection.send(answer.model_copy(update={"id": command.id}).model_dump_json())
        elif path.endswith("/live"):
            await connection.send(json.dumps({"type": "snapshot", "run": RUN, "leaderboard": self.board}))
            await connection.wait_closed()

    def _http(self, connection: Any, request: Any) -> Any:
        path = request.path
        if path == "/api/v1/ws" and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return connection.respond(
                HTTPStatus.UNAUTHORIZED, '{"error": "unauthorized", "detail": "token"}\n'
            )
        if path == "/api/v1/leaderboard":
            body = json.dumps({"run": None, "entries": OVERALL, "generated_at": NOW})
            response = connection.respond(HTTPStatus.OK, body)
            response.headers["Content-Type"] = "application/json"
            return response
        return None

    def start(self) -> None:
        ready = threading.Event()

        async def main() -> None:
            from websockets.asyncio.server import serve

            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with serve(
                self._handle, "127.0.0.1", 0, process_request=self._http, max_size=16 << 20, close_timeout=1
            ) as server:
                port = next(iter(server.sockets)).getsockname()[1]
                self.url = f"http://127.0.0.1:{port}"
                ready.set()
                await self._stop.wait()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fixed agent did not start")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


@contextlib.contextmanager
def fixed_agent(state: AgentState, **kwargs: Any) -> Iterator[FixedAgent]:
    agent = FixedAgent(state=state, **kwargs)
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


@contextlib.asynccontextmanager
async def running_agent(state: AgentState, **kwargs: Any) -> AsyncIterator[FixedAgent]:
    """:func:`fixed_agent` for async tests: stopping it leaves the test's event loop running, so that
    the app's connections can finish closing meanwhile."""
    agent = FixedAgent(state=state, **kwargs)
    agent.start()
    try:
        yield agent
    finally:
        await asyncio.to_thread(agent.stop)
