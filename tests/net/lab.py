"""A network lab of Linux network namespaces: public hosts on a shared "internet", homes behind NAT routers.

::

    with Lab() as lab:
        server = lab.public("server")              # 10.201.0.2 on the internet bridge
        alice = lab.home("alice", up_mbit=10)      # 192.168.1.2 behind a NAT router (10.201.0.101)
        bob = lab.home("bob")                      # 192.168.2.2 behind another (10.201.0.102)
        process = alice.popen([sys.executable, "-m", "volunteer_app", ...])
        lab.cut(alice)                             # the home's uplink goes down ...
        lab.heal(alice)                            # ... and comes back

Everything lives in namespaces the lab creates (their names start with :attr:`Lab.prefix`); no interface,
address or rule of the machine's own namespace is touched. The internet is a bridge in a namespace of its
own; each host is a namespace joined to it by a veth pair. A home's router is a namespace with two links
(``wan`` on the internet, ``lan`` to the home's host) that masquerades the home's traffic behind its WAN
address and drops what nobody inside asked for (nftables: a forward chain that accepts only replies), like a
home router without port forwarding. Rates are ``tbf`` qdiscs on the router's two links (this kernel has no
``netem``, so no added latency). :meth:`Lab.close` (or leaving the ``with`` block, even by an exception)
kills every process started in the lab and deletes its namespaces, which deletes their links.

Needs root, ``ip`` (iproute2), ``tc`` and ``nft`` (nftables); :func:`missing` says what is absent.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

INTERNET = "10.201.0"
"""The internet's /24: public hosts from .2, home routers' WAN addresses from .101."""
HOME_LAN = "192.168.{}"
"""Home number n gets 192.168.n.0/24: the router is .1, the host .2."""
TOOLS = ("ip", "tc", "nft")


def missing() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the network lab needs root (it creates network namespaces)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"the network lab needs {', '.join(absent)} (apt-get install iproute2 nftables)"
    return None


class LabError(RuntimeError):
    """A command that builds the lab failed; its message has the command and what it printed."""


def run(
    *argv: str,
    namespace: str | None = None,
    check: bool = True,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run one short command (in ``namespace`` if given); returns its stdout."""
    command = ["ip", "netns", "exec", namespace, *argv] if namespace else list(argv)
    done = subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=30, check=False, env=env
    )
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class Host:
    """One machine of the lab: a network namespace with one address."""

    lab: Lab
    name: str
    namespace: str
    address: str
    router: str | None = None
    """The namespace of this host's NAT router (homes only)."""
    public_address: str | None = None
    """The address the internet sees this host's traffic come from: its router's WAN address for a home."""
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process on this host; the lab kills it (and its process group) when it closes."""
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv], **kwargs)
        self.processes.append(process)
        return process

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        return run(*argv, namespace=self.namespace, check=check, env=env)

    @property
    def behind_nat(self) -> bool:
        return self.router is not None


class Lab:
    """A set of namespaces, torn down by :meth:`close`; use it as a context manager."""

    def __init__(self) -> None:
        reason = missing()
        if reason:
            raise LabError(reason)
        self.prefix = f"vlab-{uuid.uuid4().hex[:6]}-"
        self.internet = self.prefix + "inet"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._public_numbers = itertools.count(2)
        self._home_numbers = itertools.count(1)
        self._links = itertools.count()
        try:
            self._namespace(self.internet)
            run("ip", "link", "add", "br0", "type", "bridge", namespace=self.internet)
            run("ip", "link", "set", "br0", "up", namespace=self.internet)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # building

    def _namespace(self, namespace: str) -> None:
        run("ip", "netns", "add", namespace)
        self._namespaces.append(namespace)
        run("ip", "link", "set", "lo", "up", namespace=namespace)

    def _to_internet(self, namespace: str, device: str, address: str) -> None:
        """A veth pair from ``namespace`` (named ``device`` there) to the internet's bridge."""
        port = f"p{next(self._links)}"
        run(
            "ip",
            "-n",
            self.internet,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            device,
            "netns",
            namespace,
        )
        run("ip", "-n", self.internet, "link", "set", port, "master", "br0", "up")
        run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
        run("ip", "-n", namespace, "link", "set", device, "up")

    def public(self, name: str) -> Host:
        """A host with an address on the internet: anyone in the lab can connect to it."""
        namespace = self.prefix + name
        address = f"{INTERNET}.{next(self._public_numbers)}"
        self._namespace(namespace)
        self._to_internet(namespace, "eth0", address)
        host = Host(self, name, namespace, address, public_address=address)
        self.hosts[name] = host
        return host

    def home(self, name: str, *, up_mbit: float | None = None, down_mbit: float | None = None) -> Host:
        """A host behind its own NAT router: it can connect out; nobody can connect in (no port forwarding).
        ``up_mbit``/``down_mbit`` limit its uplink and downlink (:meth:`limit`)."""
        number = next(self._home_numbers)
        lan = HOME_LAN.format(number)
        router = self.prefix + name + "-nat"
        namespace = self.prefix + name
        wan_address = f"{INTERNET}.{100 + number}"
        self._namespace(router)
        self._namespace(namespace)
        self._to_internet(router, "wan", wan_address)
        run(
            "ip",
            "-n",
            router,
            "link",
            "add",
            "lan",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            namespace,
        )
        run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan")
        run("ip", "-n", router, "link", "set", "lan", "up")
        run("ip", "-n", namespace, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        run("ip", "-n", namespace, "link", "set", "eth0", "up")
        run("ip", "-n", namespace, "route", "add", "default", "via", f"{lan}.1")
        run("sysctl", "-qw", "net.ipv4.ip_forward=1", namespace=router)
        run("nft", "-f", "-", namespace=router, stdin=NAT_RULES)
        host = Host(self, name, namespace, f"{lan}.2", router=router, public_address=wan_address)
        self.hosts[name] = host
        if up_mbit is not None or down_mbit is not None:
            self.limit(host, up_mbit=up_mbit, down_mbit=down_mbit)
        return host

    # changing

    def limit(self, host: Host, *, up_mbit: float | None = None, down_mbit: float | None = None) -> None:
        """Rate-limit a home's uplink (what it sends to the internet) and downlink with token buckets."""
        if host.router is None:
            raise LabError(f"{host.name} is not a home; limit a home's links")
        for device, mbit in (("wan", up_mbit), ("lan", down_mbit)):
            run("tc", "qdisc", "del", "dev", device, "root", namespace=host.router, check=False)
            if mbit is not None:
                # a burst of ~5 ms at the rate (at least 16 KB, or tbf cannot send a full-size frame at low rates),
                # and a queue of ~200 ms, as a home router's buffer
                burst = max(16_000, int(mbit * 1e6 / 8 * 0.005))
                limit = max(64_000, int(mbit * 1e6 / 8 * 0.2))
                run(
                    "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", str(burst), "limit", str(limit), namespace=host.router,
                )  # fmt: skip

    def cut(self, host: Host) -> None:
        """Take the host's link to the internet down (a home's WAN; a public host's own link)."""
        self._set_link(host, "down")

    def heal(self, host: Host) -> None:
        """Bring it back (the same addresses; established connections may have died meanwhile)."""
        self._set_link(host, "up")

    def _set_link(self, host: Host, state: str) -> None:
        if host.router is not None:
            run("ip", "-n", host.router, "link", "set", "wan", state)
        else:
            run("ip", "-n", host.namespace, "link", "set", "eth0", state)

    # tearing down

    def close(self) -> None:
        """Kill every process started in the lab, then delete its namespaces (and with them their links)."""
        for host in self.hosts.values():
            for process in host.processes:
                stop(process)
        # anything else still running in a namespace (a daemon a process left behind) dies with it
        for namespace in self._namespaces:
            for pid in run("ip", "netns", "pids", namespace, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for namespace in reversed(self._namespaces):
            run("ip", "netns", "delete", namespace, check=False)
        self._namespaces.clear()


NAT_RULES = """
table ip vlab_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" masquerade
    }
}
table inet vlab_filter {
    chain forwarding {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
    }
    chain incoming {
        type filter hook input priority filter; policy drop;
        ct state established,related accept
        iifname "lo" accept
        iifname "lan" accept
        icmp type echo-request accept
    }
}
"""
"""A home router: the home's connections leave with the router's WAN address; only their replies come in
(nothing else reaches the home host, or the router itself from the internet, except ping)."""


def stop(process: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """SIGTERM the process's group, SIGKILL it after ``grace`` seconds."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def leftover_namespaces() -> list[str]:
    """The lab's namespaces that still exist (none, once every lab has closed)."""
    return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.startswith("vlab-")]
