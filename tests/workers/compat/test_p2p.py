"""workers/compat/p2p.py: the daemon's arguments for relayed peers and relays (the network lab,
tests/net/test_reachability.py, shows them at work across NAT)."""

from __future__ import annotations

import pytest
from hivemind.p2p import P2P

from workers import compat

RELAY = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWEGZKjWXJRmumizjg6sRNnaXYvjaUuseiAnVqXbGpJHQw"


def test_a_daemon_that_names_its_relays_reserves_on_them_without_discovery_and_install_wraps_once() -> None:
    compat.install_static_relays()
    compat.install_static_relays()
    args = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=RELAY, relay=True)
    assert args[-1] == "-relayDiscovery=0" and args.count("-relayDiscovery=0") == 1
    # daemons without trusted relays keep hivemind's arguments exactly
    assert P2P._make_process_args("p2pd", autoRelay=True, relay=True) == ["p2pd", "-autoRelay=1", "-relay=1"]
    assert P2P._make_process_args("p2pd", autoRelay=False, trustedRelays=RELAY) == [
        "p2pd", "-autoRelay=0", f"-trustedRelays={RELAY}"
    ]  # fmt: skip


def test_a_relayed_peer_announces_only_addresses_through_its_relays() -> None:
    options = compat.relayed_options(
        [RELAY, "/ip4/203.0.113.8/tcp/1"]
    )  # an address without an id is no relay
    assert options["trusted_relays"] == [RELAY]
    assert options["announce_maddrs"] == [f"{RELAY}/p2p-circuit"]
    assert options["force_reachability"] == "private" and options["use_auto_relay"] and options["use_relay"]
    with pytest.raises(ValueError, match="at least one relay"):
        compat.relayed_options(["/ip4/203.0.113.8/tcp/1"])
    assert compat.relay_service_options()["force_reachability"] == "public"
