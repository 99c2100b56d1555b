"""``p2p/p2p_daemon.py``: reaching volunteers behind NAT through circuit relays (libp2p circuit relay v2).

A volunteer behind a home router cannot be dialled: without help, it can average only as a client (it sends
its parts to others but reduces none) and two such volunteers can never average together. libp2p's answer
is a relay: the unreachable peer holds a reservation on a public peer, announces an address *through* that
peer (``/ip4/RELAY/tcp/PORT/p2p/RELAYID/p2p-circuit``), and anyone who dials that address reaches it over
the connection it opened itself. The coordinator's swarm peer is public and serves as the relay
(:func:`relay_service_options`); an unreachable volunteer uses it (:func:`relayed_options`).

Three things in hivemind 1.1.12 stand in the way, each measured in the network lab (``tests/net``):

* ``hivemind.P2P`` offers no way to turn off the daemon's relay *discovery*, and with discovery on (its
  default) the daemon's autorelay waits for four relay candidates or three minutes before it reserves a slot
  on the one relay it was given. :func:`install_static_relays` passes ``-relayDiscovery=0`` whenever a peer
  names its trusted relays, so the daemon reserves on them at once (in the lab: a reservation within 0.1 s
  of start, where with discovery on no address through the relay appeared in 60 s).
* A relay serves only while it believes itself publicly reachable, which its AutoNAT never concludes without
  other public peers: the relay's reachability is forced public.
* A peer with a reservation does not announce the address through its relay (its identify record stays
  empty); so the relayed address is announced explicitly, and other peers' daemons learn it from identify
  and the libp2p DHT like any other address. (Dialling it from Python is no way round: hivemind's multiaddr
  encodes ``/p2p/`` as a CID, which the daemon cannot parse.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from hivemind.p2p import P2P

from workers.compat.version import require

require(P2P, "_make_process_args")


def install_static_relays() -> None:
    """Have every p2p daemon this process (and its children) starts reserve on its trusted relays at once.

    Replaces ``P2P._make_process_args`` (a static method) for the whole process: when the daemon is given
    ``-autoRelay=1`` and ``-trustedRelays``, ``-relayDiscovery=0`` is added. Idempotent."""
    current = P2P.__dict__["_make_process_args"].__func__
    if getattr(current, "_static_relays", False):
        return
    P2P._make_process_args = staticmethod(_with_static_relays(current))  # type: ignore[method-assign]


def _with_static_relays(make_args: Callable[..., list[str]]) -> Callable[..., list[str]]:
    @functools.wraps(make_args)
    def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_args(*args, **kwargs)

    make_process_args._static_relays = True  # type: ignore[attr-defined]
    return make_process_args


def relay_service_options() -> dict[str, Any]:
    """``hivemind.DHT``/``P2P`` options for a public peer that relays for unreachable volunteers."""
    return {"use_relay": True, "force_reachability": "public", "auto_nat": False, "nat_port_map": False}


def relayed_options(relays: Iterable[str]) -> dict[str, Any]:
    """``hivemind.DHT``/``P2P`` options for a peer that nobody can dial: it reserves a slot on each relay
    (full multiaddrs with ``/p2p/ID``: the coordinator's swarm peers) and announces only the addresses
    through them. Needs :func:`install_static_relays` in the process that starts the daemon."""
    relays = [str(relay) for relay in relays if "/p2p/" in str(relay) and "p2p-circuit" not in str(relay)]
    if not relays:
        raise ValueError("a relayed peer needs at least one relay address with its peer id (/p2p/...)")
    return {
        "use_relay": True,
        "use_auto_relay": True,
        "trusted_relays": relays,
        "force_reachability": "private",
        "announce_maddrs": [f"{relay}/p2p-circuit" for relay in relays],
        "auto_nat": False,
        "nat_port_map": False,
    }
