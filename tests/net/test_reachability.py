"""Volunteers behind home NAT take part in the swarm without any flag: the coordinator dials each back at
join and tells the unreachable ones to go through the run's swarm peer, a circuit relay."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import python_env
from tests.net.lab import Host, Lab
from tests.workers.test_collaborative_training import Peer

pytestmark = [pytest.mark.timeout(600)]

PORT = 8470


def create_run(data: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "runs", "create", "--data-dir", str(data), "--name", "shapes",
         "--task", "shapes-dalle", "--preset", "tiny", "--config", "samples_per_shard=128", "--target-batch-size",
         "256", "--matchmaking-time", "2", "--averaging-timeout", "20", "--average-state-every", "2"],
        check=True, env=python_env(), capture_output=True,
    )  # fmt: skip


def serve(server: Host, data: Path, **env: str) -> str:
    """``volunteer-coordinator serve`` on the public host; returns its URL once it serves."""
    process = server.popen(
        [sys.executable, "-m", "coordinator.cli", "serve", "--data-dir", str(data), "--host", server.address,
         "--port", str(PORT)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=python_env(VOLUNTEER_COORDINATOR_SWARM__POLL_INTERVAL="1", **env),
    )  # fmt: skip
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if "serving at " in line:
            return f"http://{server.address}:{PORT}"
        if not line and process.poll() is not None:
            break
    raise AssertionError("serve did not start:\n" + "".join(seen))


LISTEN = """
import sys, time
from volunteer_app.agent.dialback import DialbackListener
with DialbackListener("0.0.0.0") as listener:
    print(listener.port, listener.nonce, flush=True)
    time.sleep(60)
"""
DIAL = "import sys; from coordinator.reachability import dial_back; print(*dial_back(*sys.argv[1:3], sys.argv[3]), sep='|')"


def test_the_dial_back_reaches_a_public_volunteer_and_not_one_behind_nat(lab: Lab) -> None:
    server = lab.public("server")
    public = lab.public("public")
    home = lab.home("home")
    for volunteer, expected in (
        (public, "True|reached"),
        (home, "False|timed out: behind NAT or a firewall"),
    ):
        listening = volunteer.popen(
            [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True, env=python_env()
        )
        assert listening.stdout is not None
        port, nonce = listening.stdout.readline().split()
        # the coordinator dials the address the join came from: a home's router's
        assert volunteer.public_address is not None
        out = server.run(
            sys.executable, "-c", DIAL, volunteer.public_address, port, nonce, env=python_env()
        ).strip()
        assert out == expected, (volunteer.name, out)
        listening.kill()


@pytest.fixture
def agents() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for agent in started:
        if agent.process.poll() is None:
            agent.kill()


def two_homes_join(lab: Lab, agents: list[Peer], tmp_path: Path, **coordinator_env: str) -> None:
    """A coordinator on a public host and two agents each behind its own NAT router, started with the README's
    ``join`` line (plus the test's config dir, one thread and JSON output): no --listen-host, no --no-incoming,
    nothing about the network."""
    server = lab.public("server")
    homes = [lab.home("alice"), lab.home("bob")]
    data = tmp_path / "data"
    create_run(data)
    url = serve(server, data, **coordinator_env)
    for home in homes:
        namespace = ("ip", "netns", "exec", home.namespace)
        agents.append(Peer(url, "shapes", home.name, tmp_path, prefix=namespace, listen_host=None))


@pytest.mark.swarm
def test_two_volunteers_behind_nat_join_with_the_readme_line_and_average_together_through_the_relay(
    lab: Lab, agents: list[Peer], tmp_path: Path
) -> None:
    two_homes_join(lab, agents, tmp_path)
    for agent in agents:
        status = agent.wait_for("the join", lambda s: s.get("reachability") is not None, 180)
        assert status["reachability"] == "relayed", status
        assert "could not dial" in status["reachability_reason"], status
        assert any("through the coordinator's relay" in m for m in agent.messages()), agent.messages()
    # both average, with each other (the swarm is the two of them: the coordinator's peer trains nothing)
    for agent in agents:
        status = agent.wait_for(
            "two averaging rounds",
            lambda s: s.get("averaging_rounds", 0) >= 2 and s.get("swarm_size") == 2,
            300,
        )
        assert status["maddrs"] and all("p2p-circuit" in m for m in status["maddrs"]), status["maddrs"]


@pytest.mark.swarm
def test_without_a_relay_two_volunteers_behind_nat_are_clients_and_are_told_their_work_reaches_nobody(
    lab: Lab, agents: list[Peer], tmp_path: Path
) -> None:
    """What the issue saw, now said: an organizer who turned the relay off leaves unreachable volunteers as
    clients, and two clients cannot average with each other; each agent says so within a few rounds."""
    two_homes_join(lab, agents, tmp_path, VOLUNTEER_COORDINATOR_SWARM__RELAY="false")
    for agent in agents:
        status = agent.wait_for("the isolation warning", lambda s: s.get("isolated") is not None, 240)
        assert status["reachability"] == "client", status
        assert status["averaging_rounds"] == 0 and status["swarm_size"] == 2, status
        assert "two clients cannot average with each other" in status["isolated"], status
        assert any("not reaching the shared model" in m for m in agent.messages()), agent.messages()
