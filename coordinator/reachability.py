"""How a joining volunteer's worker takes part in its run's swarm: direct, relayed or client.

At join the agent listens on the TCP port its worker will use and says so (``JoinRequest.listen_port``) with a
random nonce; the coordinator dials the address the request came from at that port and reads the nonce back.
A volunteer it reaches is dialled directly by everyone (``direct``). One it cannot reach (a home router
without port forwarding, a firewall) takes part through the run's swarm peer, a circuit relay
(``relayed``: its averaging traffic passes through this server), or, when the coordinator relays nothing,
as a client (``client``: it dials others, reduces no parts, and cannot average with another client).

The dial-back only ever dials the caller's own address (a volunteer cannot point it elsewhere), once per join
(joins are rate-limited), with a short timeout, and only the nonce counts: a different service listening on
that port does not make the volunteer reachable.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

from volunteer_app.protocol import CLIENT, DIRECT, RELAYED, JoinRequest

DIALBACK_TIMEOUT = 2.0
"""Seconds the dial-back waits for the connection and the nonce (a NAT drops the connection attempt: the
whole timeout is spent, once per join)."""


@dataclass(frozen=True)
class Reachability:
    mode: str
    reason: str


def decide(
    request: JoinRequest, *, client_host: str, relay: bool, timeout: float = DIALBACK_TIMEOUT
) -> Reachability:
    """The worker's mode for a join from ``client_host`` (``relay``: the run's swarm peer relays)."""
    unreachable = RELAYED if relay else CLIENT
    through = "through the coordinator's relay" if relay else "as a client (the coordinator relays nothing)"
    if request.profile.accepts_connections is False:
        return Reachability(unreachable, f"--no-incoming: takes part {through}")
    if request.listen_port is None or request.dialback_nonce is None:
        return Reachability(DIRECT, "not checked (the agent named no port to dial back)")
    try:
        ipaddress.ip_address(client_host)
    except ValueError:  # behind a proxy that names no address: nothing to dial (and no name is looked up)
        return Reachability(
            DIRECT, f"not checked (the caller's address {client_host[:60]!r} is not an IP address)"
        )
    reached, why = dial_back(client_host, request.listen_port, request.dialback_nonce, timeout=timeout)
    where = f"{client_host}:{request.listen_port}"
    if reached:
        return Reachability(DIRECT, f"the coordinator dialled it back at {where}")
    return Reachability(unreachable, f"the coordinator could not dial {where} ({why}): takes part {through}")


def dial_back(host: str, port: int, nonce: str, *, timeout: float = DIALBACK_TIMEOUT) -> tuple[bool, str]:
    """Connect to ``host:port`` and read ``nonce`` (the agent's listener sends it with a newline)."""
    deadline = time.monotonic() + timeout
    try:
        connection = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        return False, "timed out: behind NAT or a firewall"
    except ConnectionRefusedError:
        return False, "refused: nothing listens there from outside"
    except OSError as exc:
        return False, exc.strerror or type(exc).__name__
    received = b""
    with connection:
        try:
            while b"\n" not in received and len(received) < 256:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, "no answer"
                connection.settimeout(left)
                chunk = connection.recv(256)
                if not chunk:
                    break
                received += chunk
        except TimeoutError:
            return False, "no answer"
        except OSError as exc:
            return False, exc.strerror or type(exc).__name__
    if received.split(b"\n", 1)[0].decode(errors="replace").strip() != nonce:
        return False, "another service answered"
    return True, "reached"
