"""The worker process on its own pipe: evaluate and limits commands against a real worker in a real swarm.

A real ``serve`` (with the run's swarm peer) admits a volunteer over HTTP; the test then speaks the JSON-lines
protocol of ``volunteer_app.worker_protocol`` to ``python -m workers.worker`` directly, as the agent does.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PROFILE, python_env, start_serve, stop_serve
from volunteer_app.identity import ensure_rsa_key, public_key_openssh
from volunteer_app.protocol import JoinResponse
from volunteer_app.worker_protocol import (
    EVENTS,
    EvalEvent,
    EvaluateCommand,
    LimitsCommand,
    ProgressEvent,
    ReadyEvent,
    StopCommand,
    StoppedEvent,
    WorkerStart,
    encode,
)
from workers.tasks.shapes_dalle import SHOWCASE_PROMPTS

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


class Worker:
    def __init__(self, start: WorkerStart):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=python_env(), start_new_session=True,
        )  # fmt: skip
        self.events: queue.Queue[Any] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.process.stderr or []), daemon=True).start()
        self.send(start)

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.put(EVENTS.validate_json(line))

    def send(self, message: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(encode(message))
        self.process.stdin.flush()

    def wait_for(self, what: str, predicate: Callable[[Any], bool], timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                assert self.process.poll() is None, f"the worker exited: {''.join(self.stderr)[-3000:]}"
                continue
            if predicate(event):
                return event
        raise AssertionError(f"timed out waiting for {what}: {''.join(self.stderr)[-3000:]}")


def _swarm(
    tmp_path: Path, started: list[Any], *, config: list[str], peers: int, preset: str = "tiny"
) -> Iterator[list[tuple[JoinResponse, Path]]]:
    """A ``serve`` with one run and ``peers`` volunteers joined to it (their join answers and key files)."""
    data = tmp_path / "data"
    flags = [flag for item in config for flag in ("--config", item)]
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "pipe",
         "--task", "shapes-dalle", "--preset", preset, *flags],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    serve, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1"))
    joined = []
    with httpx.Client(base_url=url, timeout=10) as http:
        deadline = time.monotonic() + 60
        while not http.get("/api/v1/runs/pipe").json()["initial_peers"]:
            assert time.monotonic() < deadline, "the run's swarm peer never came up"
            time.sleep(0.5)
        for i in range(peers):
            credential = http.post("/api/v1/volunteers", json={"name": f"piper{i}"}).json()["credential"]
            key = tmp_path / f"peer{i}.rsa"
            body = {
                "profile": PROFILE,
                "agent_version": "t",
                "peer_public_key": public_key_openssh(ensure_rsa_key(key)),
                "max_threads": 1 if peers > 1 else None,
            }
            headers = {"Authorization": f"Bearer {credential}"}
            answer = http.post("/api/v1/runs/pipe/join", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            joined.append((JoinResponse.model_validate(answer.json()), key))
    yield joined
    stop_serve(serve)


@pytest.fixture
def joined(tmp_path: Path, kill_leftovers: list[Any]) -> Iterator[tuple[JoinResponse, Path]]:
    for peers in _swarm(tmp_path, kill_leftovers, config=["eval_prompts=8", "eval_samples=16"], peers=1):
        yield peers[0]


def test_the_worker_draws_prompts_changes_threads_live_and_keeps_training(
    joined: tuple[JoinResponse, Path],
) -> None:
    join, key = joined
    assert join.assignment.threads == 2
    worker = Worker(
        WorkerStart(join=join, peer_key_path=str(key), listen_host="127.0.0.1", report_interval=0.3)
    )
    try:
        ready = worker.wait_for("ready", lambda e: isinstance(e, ReadyEvent), 180)
        assert ready.threads == 2
        worker.wait_for("training", lambda e: isinstance(e, ProgressEvent) and e.samples_total > 0)
        worker.send(LimitsCommand(threads=1))
        worker.wait_for("one thread", lambda e: isinstance(e, ProgressEvent) and e.threads == 1, 60)

        worker.send(
            EvaluateCommand(
                request_id="typed",
                prompts=["a big red circle in the center", "a purple elephant"],
                metrics=False,
            )
        )
        drawn = worker.wait_for(
            "drawings", lambda e: isinstance(e, EvalEvent) and e.request_id == "typed", 60
        )
        assert drawn.metrics == {} and [s.prompt for s in drawn.samples][1] == "a purple elephant"
        picture, nonsense = drawn.samples
        assert picture.kind == "image" and picture.image is not None and picture.error is None
        assert (picture.image.width, picture.image.height) == (32, 32) and picture.correct in (True, False)
        assert nonsense.image is None and "elephant" in (nonsense.error or "")

        worker.send(EvaluateCommand(request_id="showcase", max_samples=8))
        showcase = worker.wait_for(
            "showcase", lambda e: isinstance(e, EvalEvent) and e.request_id == "showcase", 60
        )
        assert [s.prompt for s in showcase.samples] == list(SHOWCASE_PROMPTS)
        assert set(showcase.metrics) >= {"loss", "prompt_accuracy"}

        # evaluating paused training only for a moment: it goes on afterwards
        before = worker.wait_for("progress", lambda e: isinstance(e, ProgressEvent)).samples_total
        worker.wait_for(
            "more training", lambda e: isinstance(e, ProgressEvent) and e.samples_total > before + 64
        )
        worker.send(StopCommand())
        worker.wait_for("stopped", lambda e: isinstance(e, StoppedEvent), 120)
        assert worker.process.wait(timeout=60) == 0
    finally:
        if worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGKILL)
    assert not [line for line in worker.stderr if "Traceback" in line], "".join(worker.stderr)[-3000:]
    json.dumps(showcase.model_dump(mode="json"))


def test_a_swarm_address_nobody_answers_at_is_a_clear_error_not_a_hang(
    joined: tuple[JoinResponse, Path],
) -> None:
    """The worker starts its DHT in the background while it builds the model; a swarm it cannot reach
    must still end in one clear, fatal error (the agent shows it and rejoins), not a traceback or a hang."""
    import socket

    from volunteer_app.worker_protocol import ErrorEvent

    join, key = joined
    with socket.socket() as s:  # a port nobody listens on, with the swarm peer's identity
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer_id = join.initial_peers[0].rsplit("/p2p/", 1)[1]
    dead = join.model_copy(update={"initial_peers": [f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"]})
    worker = Worker(WorkerStart(join=dead, peer_key_path=str(key), listen_host="127.0.0.1"))
    try:
        error = worker.wait_for("the error", lambda e: isinstance(e, ErrorEvent) and e.fatal, 120)
        assert error.message.startswith(f"cannot join the run's swarm at /ip4/127.0.0.1/tcp/{port}/"), error
        assert worker.process.wait(timeout=60) == 3
    finally:
        if worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGKILL)
    assert not [line for line in worker.stderr if "Traceback" in line], "".join(worker.stderr)[-3000:]
