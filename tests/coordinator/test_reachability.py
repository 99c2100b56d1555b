"""The coordinator's dial-back at join and the verdict it gives (the network lab, tests/net, shows it across
NAT): only the agent's nonce counts, and an unreachable volunteer is relayed where the coordinator relays."""

from __future__ import annotations

import socket
import threading

import pytest

from coordinator.reachability import decide, dial_back
from tests.conftest import PROFILE
from volunteer_app.agent.dialback import DialbackListener
from volunteer_app.protocol import CLIENT, DIRECT, RELAYED, HardwareProfile, JoinRequest

KEY = "ssh-rsa " + "A" * 300


def request(**fields: object) -> JoinRequest:
    profile = HardwareProfile.model_validate({**PROFILE, "cpu_model": "x"})
    if "accepts_connections" in fields:
        profile = profile.model_copy(update={"accepts_connections": fields.pop("accepts_connections")})
    return JoinRequest(profile=profile, agent_version="t", peer_public_key=KEY, **fields)  # type: ignore[arg-type]


def test_the_dial_back_reads_the_agents_nonce_and_nothing_else_counts() -> None:
    with DialbackListener("127.0.0.1") as listener:
        assert dial_back("127.0.0.1", listener.port, listener.nonce) == (True, "reached")
        assert (
            dial_back("127.0.0.1", listener.port, "another-nonce-0123456789")[1] == "another service answered"
        )
        assert listener.answered == 2
    # the port closed with the listener: refused
    reached, why = dial_back("127.0.0.1", listener.port, listener.nonce)
    assert not reached and why.startswith("refused")


def test_a_service_that_says_nothing_is_not_the_agent() -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True)
    thread.start()
    try:
        reached, why = dial_back("127.0.0.1", silent.getsockname()[1], "n" * 24, timeout=0.5)
        assert not reached and why == "no answer"
    finally:
        thread.join(timeout=2)
        for connection in accepted:
            connection.close()
        silent.close()


def test_the_listener_takes_another_port_when_its_own_is_in_use() -> None:
    with DialbackListener("127.0.0.1") as first, DialbackListener("127.0.0.1", first.port) as second:
        assert second.port != first.port
        assert dial_back("127.0.0.1", second.port, second.nonce)[0]


@pytest.mark.parametrize(("relay", "mode"), [(True, RELAYED), (False, CLIENT)])
def test_the_verdict_follows_the_dial_back_and_the_relay(relay: bool, mode: str) -> None:
    with DialbackListener("127.0.0.1") as listener:
        port, nonce = listener.port, listener.nonce
    # nobody listens there any more: from a non-loopback address, that is unreachable
    verdict = decide(request(listen_port=port, dialback_nonce=nonce), client_host="127.0.0.2", relay=relay)
    assert verdict.mode == mode, verdict
    assert "could not dial 127.0.0.2:" in verdict.reason
    with DialbackListener("0.0.0.0") as listener:
        reached = decide(
            request(listen_port=listener.port, dialback_nonce=listener.nonce),
            client_host="127.0.0.2",
            relay=relay,
        )
    assert reached.mode == DIRECT and "dialled it back" in reached.reason
    # --no-incoming is believed without a dial (it only ever costs the volunteer), and an agent that names no
    # port keeps what it had before (direct)
    assert decide(request(accepts_connections=False), client_host="203.0.113.9", relay=relay).mode == mode
    assert decide(request(), client_host="203.0.113.9", relay=relay).mode == DIRECT
    # a caller without an IP address (a test client, a proxy that names none) is not dialled, nor looked up
    unnamed = decide(request(listen_port=port, dialback_nonce=nonce), client_host="testclient", relay=relay)
    assert unnamed.mode == DIRECT and "not an IP address" in unnamed.reason
    # a volunteer on the coordinator's own computer is dialled back like any other
    nobody = request(listen_port=port, dialback_nonce=nonce)
    assert decide(nobody, client_host="127.0.0.1", relay=relay).mode == mode
