"""The lab itself: homes reach the internet from behind NAT, nobody reaches into a home, rates are limited,
links go down and come back, and nothing is left behind."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest

from tests.net.lab import Host, Lab, leftover_namespaces, missing

PROBE = str(Path(__file__).with_name("probe.py"))
PORT = 7000


def serve(host: Host, port: int = PORT) -> None:
    process = host.popen([sys.executable, PROBE, "serve", str(port)], stdout=PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "listening"


def connect(host: Host, address: str, *, port: int = PORT, send: int = 0, timeout: float = 3.0) -> dict:
    argv = [
        sys.executable,
        PROBE,
        "connect",
        address,
        str(port),
        "--send",
        str(send),
        "--timeout",
        str(timeout),
    ]
    return json.loads(host.run(*argv))


def test_a_home_reaches_a_public_host_seen_as_its_routers_address_and_nobody_reaches_into_a_home(
    lab: Lab,
) -> None:
    server = lab.public("server")
    alice = lab.home("alice")
    bob = lab.home("bob")
    serve(server)
    serve(alice)
    serve(bob)

    out = connect(alice, server.address, send=1000)
    assert out["ok"], out
    assert out["seen_as"] == alice.public_address != alice.address  # masqueraded
    assert out["received"] == 1000
    assert connect(bob, server.address)["seen_as"] == bob.public_address

    # no port forwarding: unsolicited connections to a home's router are dropped (a timeout, not a refusal)
    inbound = connect(server, alice.public_address, timeout=1.5)
    assert not inbound["ok"] and "timed out" in inbound["error"], inbound
    assert not connect(bob, alice.public_address, timeout=1.5)["ok"]
    # and the homes' private addresses lead nowhere from outside
    assert not connect(server, alice.address, timeout=1.5)["ok"]
    # while a home still reaches itself
    assert connect(alice, alice.address)["ok"]


def test_a_homes_uplink_is_limited_to_its_rate(lab: Lab) -> None:
    server = lab.public("server")
    slow = lab.home("slow", up_mbit=8)
    fast = lab.home("fast")
    serve(server)
    size = 2_000_000  # 2 s at 8 Mbit/s

    limited = connect(slow, server.address, send=size, timeout=30)
    unlimited = connect(fast, server.address, send=size, timeout=30)
    assert limited["ok"] and limited["received"] == size, limited
    assert unlimited["ok"] and unlimited["received"] == size, unlimited
    rate = size * 8 / limited["seconds"] / 1e6
    # a token bucket never lets more than its rate through (a short burst aside)
    assert rate < 8 * 1.15, f"{rate:.1f} Mbit/s through an 8 Mbit/s uplink"
    assert unlimited["seconds"] < limited["seconds"], (unlimited, limited)

    lab.limit(slow, up_mbit=None)  # lifted
    assert connect(slow, server.address, send=size, timeout=30)["seconds"] < limited["seconds"]


def test_a_cut_link_refuses_traffic_until_it_is_healed(lab: Lab) -> None:
    server = lab.public("server")
    alice = lab.home("alice")
    serve(server)
    assert connect(alice, server.address)["ok"]

    lab.cut(alice)
    cut = connect(alice, server.address, timeout=1.5)
    assert not cut["ok"], cut

    lab.heal(alice)
    deadline = time.monotonic() + 10
    while not (healed := connect(alice, server.address, timeout=1.5))["ok"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert healed["ok"], healed
    assert healed["seen_as"] == alice.public_address


@pytest.mark.skipif(bool(missing()), reason="the network lab cannot run here")
def test_the_lab_leaves_no_namespace_or_process_behind_even_when_a_test_fails() -> None:
    before = set(leftover_namespaces())
    with pytest.raises(RuntimeError, match="a test failed"), Lab() as lab:
        server = lab.public("server")
        lab.home("alice", up_mbit=10)
        serve(server)
        probe = server.processes[0]
        raise RuntimeError("a test failed")
    assert set(leftover_namespaces()) == before
    assert probe.poll() is not None
