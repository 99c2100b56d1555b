"""Which network addresses from a coordinator a volunteer's computer may dial.

A join answer names the swarm's first peers as multiaddrs (``/ip4/203.0.113.7/tcp/31337/p2p/Qm...``); the
worker's libp2p daemon dials each of them, at start and at every restart. A hostile coordinator could name
a port of the volunteer's own computer (``/ip4/127.0.0.1/tcp/631``), of its home network (a router's admin
page at ``/ip4/192.168.1.1/tcp/80``), or a name that resolves there. So each address is checked against
where the coordinator itself is:

* a coordinator on this computer (loopback: ``volunteer-app demo``, tests) may name any address;
* a coordinator on a private network (a lab's LAN) may name private and public addresses, never this
  computer's own (loopback, unspecified);
* a coordinator on the internet may name public addresses only.

DNS names are resolved and every address they resolve to must pass. Stdlib only.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlparse

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str], list[str]]

LOOPBACK, PRIVATE, PUBLIC = "loopback", "private", "public"


def resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to (empty when it does not)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return sorted({str(info[4][0]).split("%", 1)[0] for info in infos})


def scope_of(address: IPAddress) -> str:
    """``loopback`` for this computer (loopback and unspecified addresses), ``public`` for globally routed
    unicast addresses, ``private`` for the rest (private, link-local, shared, reserved, multicast...)."""
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    if address.is_loopback or address.is_unspecified:
        return LOOPBACK
    if address.is_global and not address.is_multicast:
        return PUBLIC
    return PRIVATE


ALLOWED = {LOOPBACK: {LOOPBACK, PRIVATE, PUBLIC}, PRIVATE: {PRIVATE, PUBLIC}, PUBLIC: {PUBLIC}}
"""Address scopes a coordinator of each scope may name."""


def _addresses(host: str, resolver: Resolver) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    found = []
    for text in resolver(host):
        try:
            found.append(ipaddress.ip_address(text))
        except ValueError:
            continue
    return found


def coordinator_scope(url: str, *, resolver: Resolver = resolve) -> str:
    """The scope of the coordinator at ``url``: its least local address (a name that resolves to both a
    loopback and a public address counts as public)."""
    host = urlparse(url).hostname or ""
    addresses = _addresses(host, resolver)
    if not addresses:
        return PUBLIC
    scopes = {scope_of(a) for a in addresses}
    return PUBLIC if PUBLIC in scopes else (PRIVATE if PRIVATE in scopes else LOOPBACK)


@dataclass(frozen=True)
class Checked:
    """The addresses kept, and each refused one with why."""

    kept: list[str]
    refused: list[tuple[str, str]]


HOST_PROTOCOLS = {"ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr"}
VALUE_PROTOCOLS = HOST_PROTOCOLS | {"tcp", "udp", "p2p", "ipfs", "certhash", "sni"}
"""Multiaddr protocols followed by a value (the others, such as ``p2p-circuit`` or ``quic-v1``, have none)."""
FLAG_PROTOCOLS = {
    "p2p-circuit",
    "quic",
    "quic-v1",
    "ws",
    "wss",
    "tls",
    "noise",
    "webtransport",
    "http",
    "https",
}


def _hosts(maddr: str) -> list[tuple[str, str]] | None:
    """(protocol, value) of every host component of a multiaddr (a relayed address has several), or None
    when it is malformed or uses a protocol this module does not know."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[0] != "":
        return None
    hosts, index = [], 1
    while index < len(parts):
        protocol = parts[index]
        if protocol in FLAG_PROTOCOLS:
            index += 1
            continue
        if protocol not in VALUE_PROTOCOLS or index + 1 >= len(parts):
            return None
        if protocol in HOST_PROTOCOLS:
            hosts.append((protocol, parts[index + 1]))
        index += 2
    return hosts


def check_peer_addresses(
    maddrs: Iterable[str], *, coordinator_url: str, resolver: Resolver = resolve
) -> Checked:
    """Split ``maddrs`` into those this computer may dial for the coordinator at ``coordinator_url`` and
    those it must not (with the reason, for the volunteer's log)."""
    allowed = ALLOWED[coordinator_scope(coordinator_url, resolver=resolver)]
    kept: list[str] = []
    refused: list[tuple[str, str]] = []
    for maddr in maddrs:
        hosts = _hosts(maddr)
        if not hosts:
            refused.append((maddr, "not an address this app dials"))
            continue
        reason = None
        for protocol, value in hosts:
            if protocol.startswith("dns"):
                addresses = _addresses(value, resolver)
            else:
                try:
                    addresses = [ipaddress.ip_address(value)]
                except ValueError:
                    addresses = []
            if not addresses:
                reason = f"{value[:80]!r} is not an address that resolves"
                break
            outside = [a for a in addresses if scope_of(a) not in allowed]
            if outside:
                where = "this computer" if scope_of(outside[0]) == LOOPBACK else "a private network"
                reason = f"{outside[0]} is on {where}, where the coordinator is not"
                break
        if reason is None:
            kept.append(maddr)
        else:
            refused.append((maddr, reason))
    return Checked(kept=kept, refused=refused)
