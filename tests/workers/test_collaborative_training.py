"""Volunteers training together: a real coordinator and real ``volunteer-app join`` processes on loopback.

One coordinator serves the whole module (its start-up and the run's swarm peer cost seconds); each
test starts its own peers. Peers run with one thread each on this 2-core machine, so the tests are
about behaviour (they learn, they share, they survive), not speed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import PROFILE, python_env, start_serve, stop_serve
from volunteer_app.identity import ensure_rsa_key, public_key_openssh
from volunteer_app.pictures import read_png
from workers.tasks.shapes_dalle import SHOWCASE_PROMPTS
from workers.tasks.tiny_lm.corpus import load_corpus

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
DHT_CLIENT = Path(__file__).resolve().parent.parent / "coordinator" / "dht_client.py"


class Peer:
    """A ``volunteer-app join --json`` process and what it printed."""

    def __init__(
        self,
        url: str,
        run: str,
        name: str,
        root: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
        listen_host: str | None = "127.0.0.1",
    ):
        """``prefix``: what the command runs under (``ip netns exec NS`` in the network lab); ``listen_host``
        None leaves the agent's default (all interfaces), as the README's ``join`` line does."""
        self.name = name
        self.config_dir = root / name
        self.lines: list[dict[str, Any]] = []
        env = {
            **python_env(
                VOLUNTEER_BENCHMARK_SECONDS="1", VOLUNTEER_STATUS_INTERVAL="1", VOLUNTEER_LOG_LEVEL="INFO"
            ),
            **(env or {}),
        }
        listen = ["--listen-host", listen_host] if listen_host else []
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "volunteer_app.cli", "join", "--foreground", "--coordinator", url, "--run", run,
             "--name", name, "--config-dir", str(self.config_dir), *listen, "--max-threads", "1", "--json", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.process.stderr or []), daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                self.lines.append({"event": "garbage", "text": line})

    @property
    def status(self) -> dict[str, Any]:
        statuses = [line for line in self.lines if line.get("event") == "status"]
        return statuses[-1] if statuses else {}

    def messages(self) -> list[str]:
        return [line.get("text", "") for line in self.lines if line.get("event") == "message"]

    def wait_for(
        self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status
            if status and predicate(status):
                return status
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        tail = "\n".join(json.dumps(line)[:300] for line in self.lines[-8:])
        messages = "\n".join(self.messages()[-15:])
        log = self.worker_log()
        raise AssertionError(
            f"{self.name}: timed out waiting for {what}\nlast status: {json.dumps(self.status)}\n"
            f"messages:\n{messages}\n{tail}\nstderr: {''.join(self._stderr)[-2000:]}\n{log}"
        )

    def worker_log(self) -> str:
        logs = list((self.config_dir / "logs").glob("*.log"))
        return logs[0].read_text()[-3000:] if logs else "(no worker log)"

    def worker_pid(self) -> int:
        for child in psutil.Process(self.process.pid).children(recursive=True):
            cmdline = child.cmdline()
            if cmdline[-2:] == ["-m", "workers.worker"] and child.ppid() == self.process.pid:
                return child.pid
        raise AssertionError(f"{self.name} has no worker process")

    def stop(self, timeout: float = 90) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        for proc in [
            psutil.Process(self.process.pid),
            *psutil.Process(self.process.pid).children(recursive=True),
        ]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    data = tmp_path_factory.mktemp("coordinator") / "data"
    # the organizer's text, on the server only: volunteers' agents fetch the coordinator's copy by its digest
    text = data.parent / "letters.txt"
    text.write_text(load_corpus(None, 200_000), encoding="utf-8")
    for name, task, extra in (
        ("shapes", "shapes-dalle", ["--preset", "tiny", "--config", "samples_per_shard=128"]),
        # local updates: each peer steps on its own and the swarm averages parameters every epoch
        ("letters", "tiny-lm", ["--preset", "tiny", "--config", "samples_per_shard=128", "--local-updates",
                                "--config", f"text_path={text}"]),
    ):  # fmt: skip
        subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", name,
             "--task", task, "--target-batch-size", "256", "--matchmaking-time", "2", "--averaging-timeout", "20",
             "--average-state-every", "2", *extra],
            check=True, env=python_env(), capture_output=True,
        )  # fmt: skip
    started: list[Any] = []
    process, url = start_serve(data, started, env=python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1"))
    # No waiting for the runs' swarm peers here: the first peers arrive while they are still starting,
    # as volunteers do after a coordinator restart, and their agents must wait for the swarm's address
    # rather than train alone (the first test checks that they end up in one swarm).
    yield url, data
    stop_serve(process)
    for p in started:
        if p.poll() is None:
            p.kill()


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        if peer.process.poll() is None:
            peer.kill()
        os.system(f"pkill -9 -f {peer.config_dir}/ >/dev/null 2>&1")  # any orphaned helper of that peer


def test_peers_train_together_share_state_keep_out_forgers_and_survive_a_dead_peer(
    coordinator: tuple[str, Path], peers: list[Peer], tmp_path: Path
) -> None:
    url, _data = coordinator
    alice = Peer(url, "shapes", "alice", tmp_path)
    bob = Peer(url, "shapes", "bob", tmp_path)
    peers += [alice, bob]
    # they train together: averaging rounds happen and the loss falls for both
    for peer in (alice, bob):
        peer.wait_for(
            "two averaging rounds",
            lambda s: s.get("averaging_rounds", 0) >= 2 and s.get("swarm_size") == 2,
            240,
        )
    for peer in (alice, bob):
        status = peer.wait_for(
            "the loss to fall", lambda s: s["loss"] is not None and s["loss"] < s["first_loss"] - 0.5, 120
        )
        assert status["bytes_sent"] > 0 and status["global_epoch"] >= 2
    assert any("credited" in m for m in alice.messages()), alice.messages()

    # a forger cannot bootstrap into the swarm through a volunteer's worker either
    mallory = httpx.post(f"{url}/api/v1/volunteers", json={"name": "mallory"}).json()
    key_path = tmp_path / "mallory.rsa"
    join = httpx.post(
        f"{url}/api/v1/runs/shapes/join",
        json={
            "profile": PROFILE,
            "agent_version": "t",
            "peer_public_key": public_key_openssh(ensure_rsa_key(key_path)),
        },
        headers={"Authorization": f"Bearer {mallory['credential']}"},
    ).json()
    forged = subprocess.run(
        [sys.executable, str(DHT_CLIENT), json.dumps({
            "initial_peers": alice.status["maddrs"], "keys": join["coordinator_keys"], "run": "shapes",
            "hivemind_run_id": join["run"]["hivemind_run_id"], "token": join["peer_token"], "key_path": str(key_path),
            "forge": True,
        })],
        capture_output=True, text=True, env=python_env(), timeout=120, check=False,
    )  # fmt: skip
    result = json.loads([line for line in forged.stdout.splitlines() if line.startswith("{")][-1])
    assert not result["joined"] and "bootstrap failed" in result["error"]

    # a late peer downloads the swarm's current state instead of starting from scratch
    carol = Peer(url, "shapes", "carol", tmp_path)
    peers.append(carol)
    status = carol.wait_for("ready", lambda s: s.get("parameters") is not None, 180)
    assert status["loaded_state_epoch"] is not None and status["loaded_state_epoch"] >= 2, status
    carol.wait_for("training", lambda s: s["samples_total"] > 0, 60)

    # bob vanishes (SIGKILL, supervisor and worker): alice and carol keep training and averaging
    bob.kill()
    before = {p.name: (p.status["samples_total"], p.status["global_epoch"]) for p in (alice, carol)}
    for peer in (alice, carol):
        peer.wait_for(
            "progress after bob died",
            lambda s, p=peer: (
                s["samples_total"] > before[p.name][0] + 300 and s["global_epoch"] > before[p.name][1]
            ),
            180,
        )
        assert peer.process.poll() is None

    # alice's worker crashes: her supervisor restarts it and her session goes on
    os.kill(alice.worker_pid(), signal.SIGKILL)
    alice.wait_for(
        "a restarted worker", lambda s: s["worker_restarts"] == 1 and s["state"] == "training", 180
    )
    assert alice.stop() == 0 and carol.stop() == 0
    summary = [line for line in alice.lines if line.get("event") == "summary"][-1]
    assert summary["samples_credited"] > 0 and summary["leases_completed"] > 0


def test_pause_and_resume_lose_no_samples(
    coordinator: tuple[str, Path], peers: list[Peer], tmp_path: Path
) -> None:
    url, data = coordinator
    dave = Peer(url, "letters", "dave", tmp_path)
    peers.append(dave)
    dave.wait_for("training", lambda s: s["state"] == "training" and s["lease_samples_done"] > 0, 180)
    # the run's text came from the coordinator into dave's cache, checked, and the worker trains on that copy
    assert any("downloaded and checked the run's file text_path" in m for m in dave.messages()), (
        dave.messages()
    )
    digest = hashlib.sha256((data.parent / "letters.txt").read_bytes()).hexdigest()
    assert (dave.config_dir / "cache" / "files" / digest).read_bytes() == (
        data.parent / "letters.txt"
    ).read_bytes()
    subprocess.run([sys.executable, "-m", "coordinator.cli", "runs", "pause", "letters", "--data-dir", str(data)],
                   check=True, env=python_env(), capture_output=True)  # fmt: skip
    paused = dave.wait_for(
        "the pause", lambda s: s["state"] == "paused" and s["paused_by"] == "organizers", 60
    )
    time.sleep(2)  # the micro-batch in flight when the pause arrived is finished and counted first
    paused = dave.status
    time.sleep(4)
    still = dave.status
    assert still["state"] == "paused"
    assert still["samples_total"] == paused["samples_total"], "a paused peer must not compute"
    assert still["lease_samples_done"] == paused["lease_samples_done"]
    subprocess.run([sys.executable, "-m", "coordinator.cli", "runs", "resume", "letters", "--data-dir", str(data)],
                   check=True, env=python_env(), capture_output=True)  # fmt: skip
    resumed = dave.wait_for(
        "training again",
        lambda s: s["state"] == "training" and s["samples_total"] > still["samples_total"],
        60,
    )
    # the shard in progress carried on where it stopped, and every shard is credited in full
    assert (
        resumed["lease_samples_done"] >= still["lease_samples_done"]
        or resumed["leases_completed"] > still["leases_completed"]
    )
    dave.wait_for(
        "a lease completed after resuming", lambda s: s["leases_completed"] > still["leases_completed"], 120
    )
    credited = [m for m in dave.messages() if "credited" in m]
    assert credited and all("credited: 128 samples" in m for m in credited), credited
    status = dave.wait_for(
        "the loss to fall", lambda s: s["loss"] is not None and s["loss"] < s["first_loss"] - 0.3, 120
    )
    assert status["samples_credited"] == 128 * status["leases_completed"]
    assert dave.stop() == 0


def test_training_goes_on_while_the_coordinator_is_down_and_reports_arrive_later(
    tmp_path: Path, peers: list[Peer], kill_leftovers: list[Any]
) -> None:
    import socket

    with socket.socket() as s:  # a fixed port, so that the restarted coordinator is found at the same URL
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "outage",
         "--task", "tiny-lm", "--config", "samples_per_shard=64", "--target-batch-size", "256"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    # leases that outlast the outage however slow the machine: the reports kept for later must still count
    env = python_env(
        VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1", VOLUNTEER_COORDINATOR_WORK__LEASE_MIN_SECONDS="900"
    )
    serve, url = start_serve(data, kill_leftovers, "--port", str(port), env=env)
    erin = Peer(url, "outage", "erin", tmp_path)
    peers.append(erin)
    erin.wait_for("a credited lease", lambda s: s["leases_completed"] >= 1, 180)
    assert stop_serve(serve) == 0
    down = erin.wait_for("training without the coordinator", lambda s: not s["coordinator_ok"], 60)
    # once its leases are done it trains on unleased shards, which are not credited, until the coordinator is back
    erin.wait_for("more samples", lambda s: s["samples_total"] > down["samples_total"] + 200, 60)
    erin.wait_for("unleased work", lambda s: s["samples_unleased"] > 0, 60)
    outbox = erin.config_dir / "outbox.json"
    deadline = time.monotonic() + 60
    while not outbox.exists():  # finished leases wait on disk while the coordinator is away
        assert time.monotonic() < deadline, "no report was kept for later"
        time.sleep(0.5)
    credited_before = erin.status["samples_credited"]
    serve, _ = start_serve(data, kill_leftovers, "--port", str(port), env=env)
    erin.wait_for(
        "reports delivered", lambda s: s["coordinator_ok"] and s["samples_credited"] > credited_before, 120
    )
    assert erin.process.poll() is None
    # the leaderboard and the agent agree on what was credited, once the agent's next status line (every few
    # seconds) has caught up with the last report it delivered
    deadline = time.monotonic() + 60
    while True:
        board = httpx.get(f"{url}/api/v1/runs/outage/leaderboard").json()["entries"]
        credited = erin.status["samples_credited"]
        if board and board[0]["volunteer"] == "erin" and board[0]["samples"] == credited:
            break
        assert time.monotonic() < deadline, (
            f"leaderboard {board} against the agent's {credited} credited samples"
        )
        time.sleep(0.5)
    assert erin.stop() == 0
    stop_serve(serve)


@pytest.mark.timeout(720)
def test_the_demo_trains_a_swarm_that_learns_to_draw_and_prints_a_summary() -> None:
    """The short swarm run of issue 9: two peers learn, together, to draw some held-out captions right.

    50k samples of the demo's model on two peers (150 s on a quiet 2-core machine, twice that on a slow day:
    a fixed duration trained 36k there and scored 0.0-0.19): with the learning rate decayed over them the
    swarm's checkpoint at 51k scored 0.24 on 256 held-out captions, so under 0.1 is a broken or stalled
    swarm, not bad luck. The real figures are the benchmark's (docs/performance.md#where-the-demos-cpu-goes).
    """
    result = subprocess.run(
        [sys.executable, "-m", "volunteer_app.cli", "demo", "--peers", "2", "--samples", "50000", "--json"],
        capture_output=True, text=True, env=python_env(), timeout=660, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["peers"] == 2
    assert (
        summary["samples"] >= 50000 and summary["samples_credited"] > 0 and summary["averaging_rounds"] >= 1
    )
    assert summary["loss_end"] < summary["loss_start"] - 0.5
    assert summary["loss_end"] < 0.25, summary  # untrained ~7; at ~60k samples ~0.11
    assert summary["prompt_accuracy"] is not None and 0.1 <= summary["prompt_accuracy"] <= 1.0, summary
    # ... evaluated on the swarm's model: the first peer's parameters averaged with its partner's
    assert "the mean of 2 peers' parameters" in summary["drawings_from"], summary["drawings_from"]
    # the summary shows the model's drawings of the showcase prompts, and writes them as a PNG
    assert [d["prompt"] for d in summary["drawings"]] == list(SHOWCASE_PROMPTS)
    assert all(d["correct"] in (True, False) for d in summary["drawings"])
    png = Path(summary["drawings_png"])
    picture = read_png(png.read_bytes())
    assert (picture.width, picture.height) == (4 * (4 * 33 + 1), 4 * (2 * 33 + 1))
    png.unlink()
    assert not [line for line in result.stderr.splitlines() if "Traceback" in line]


def test_a_swarm_that_empties_resumes_from_the_coordinators_last_intact_checkpoint(
    tmp_path: Path, peers: list[Peer], kill_leftovers: list[Any]
) -> None:
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "relay",
         "--task", "tiny-lm", "--config", "samples_per_shard=64", "--config", "eval_samples=4",
         "--target-batch-size", "128"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip
    env = python_env(
        VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1", VOLUNTEER_COORDINATOR_SWARM__CHECKPOINT_INTERVAL="3"
    )
    serve, url = start_serve(data, kill_leftovers, env=env)
    frank = Peer(url, "relay", "frank", tmp_path)
    peers.append(frank)
    frank.wait_for("a few epochs", lambda s: s["local_epoch"] >= 6, 240)
    checkpoints = data / "checkpoints" / "relay"

    def saved() -> list[Path]:
        return sorted(checkpoints.glob("epoch-*[0-9]")) if checkpoints.is_dir() else []

    deadline = time.monotonic() + 90
    while len(saved()) < 2 or int(saved()[-1].name.split("-")[1]) < 3:
        assert time.monotonic() < deadline, f"the coordinator wrote too few checkpoints: {saved()}"
        time.sleep(0.5)
    # the checkpoint says whose parameters it holds: frank's alone (two peers' mean: test_worker_parts)
    assert json.loads((saved()[-1] / "manifest.json").read_text())["averaged_peers"] == 1
    assert frank.stop() == 0
    trained_loss, initial_loss = frank.status["loss"], frank.status["first_loss"]
    # nobody is training now, the coordinator restarts, and its newest checkpoint has been damaged on disk
    assert stop_serve(serve) == 0
    newest, previous = saved()[-1], saved()[-2]
    model = newest / "model.safetensors"
    damaged = bytearray(model.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    model.write_bytes(bytes(damaged))
    previous_epoch = int(previous.name.split("-")[1])
    serve, url = start_serve(data, kill_leftovers, env=env)
    grace = Peer(url, "relay", "grace", tmp_path)
    peers.append(grace)
    status = grace.wait_for(
        "training", lambda s: s.get("parameters") is not None and s["loss"] is not None, 240
    )
    # she resumes from the previous, intact checkpoint: its epoch, and a loss near where frank left it
    assert status["loaded_state_epoch"] == previous_epoch, (status, saved())
    assert status["local_epoch"] >= previous_epoch
    assert status["first_loss"] < initial_loss - 0.5 and status["first_loss"] < trained_loss + 0.5, (
        status["first_loss"],
        initial_loss,
        trained_loss,
    )
    assert (checkpoints / f"{newest.name}.corrupt").is_dir(), (
        "the damaged checkpoint is set aside, not loaded"
    )
    assert grace.stop() == 0
    stop_serve(serve)
    assert "Traceback" not in (data / "swarm" / "relay.log").read_text()
