"""Several hosts on one machine: Linux network namespaces joined by a bridge, each with its own address.

`Network` creates (as root) a bridge and, per host, a namespace with loopback up and one veth pair into
the bridge, addressed in a private /24 with no default route: a process started with `host.prefix` sees
only its loopback and that address, and reaches the other hosts through the bridge. The test process
itself is a host too: the bridge carries `network.gateway`, so it talks to the services over the bridge
as any client would. Names carry the test process's PID, so concurrent test runs do not collide.

The subnet is one that no address or route on this machine covers yet, chosen and claimed under a lock: a
namespace left behind by an earlier run that was killed (its `close` never ran) still answers for its
addresses, and a second bridge on the same /24 sends the test process's packets there (connection refused
from a stranger, not from the service under test). `Network` also proves the test process reaches a host
before any test relies on it.

Where Docker has set iptables' FORWARD policy to DROP (and bridged packets pass through iptables), an
ACCEPT rule for the bridge is inserted and removed afterwards. `close` removes everything it created,
also after a failed setup.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
SUBNET_LOCK = Path("/run/lock/rlfabric-test-hosts.lock")
SUBNETS = range(100, 200)


class NetworkError(RuntimeError):
    """The namespaces could not be set up (not root, no iproute2, a command failed)."""


def sh(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the bridge, and the bridge-side end of its link."""

    netns: str
    address: str
    link: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """Prepended to a command to run it on this host."""
        return ("ip", "netns", "exec", self.netns)


class Network:
    """A bridge in 10.231.N.0/24 (N from the PID) and the hosts added to it."""

    def __init__(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NetworkError("network namespaces need root and iproute2's `ip`")
        self.tag = f"rlf{os.getpid()}"
        self.bridge = f"{self.tag}br"
        self.hosts: list[Host] = []
        self.forward_rule: list[str] | None = None
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            with subnet_lock():
                self.subnet = free_subnet(os.getpid())
                self.gateway = f"{self.subnet}.254"
                sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            self.allow_forwarding()
        except BaseException:
            self.close()
            raise

    def allow_forwarding(self) -> None:
        """Bridged packets pass iptables' FORWARD chain when br_netfilter is on: accept the bridge's own
        where the policy drops (dockerd sets DROP). Without iptables there is no such chain to pass."""
        if not BRIDGE_NF.exists() or BRIDGE_NF.read_text().strip() != "1" or shutil.which("iptables") is None:
            return
        if "-P FORWARD DROP" not in sh("iptables", "-S", "FORWARD"):
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        sh("iptables", "-I", *rule)
        self.forward_rule = rule

    def add_host(self, name: str) -> Host:
        """A namespace `{tag}-{name}` with loopback up and the next address of the subnet."""
        index = len(self.hosts) + 1
        host = Host(f"{self.tag}-{name}", f"{self.subnet}.{index}", f"{self.tag}v{index}")
        inner = f"{self.tag}n{index}"
        sh("ip", "netns", "add", host.netns)
        self.hosts.append(host)
        sh("ip", "link", "add", host.link, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", host.link, "master", self.bridge, "up")
        sh("ip", "link", "set", inner, "netns", host.netns)
        in_ns = ("ip", "-n", host.netns)
        sh(*in_ns, "addr", "add", f"{host.address}/24", "dev", inner)
        sh(*in_ns, "link", "set", "lo", "up")
        sh(*in_ns, "link", "set", inner, "up")
        return host

    def set_link(self, host: Host, up: bool) -> None:
        """Cuts (or restores) the host's only link: a partition of that host from all the others."""
        sh("ip", "link", "set", host.link, "up" if up else "down")

    def check_reachable(self, client: Host, server: Host) -> None:
        """Proves that a TCP connection from `client` to `server` crosses the bridge: a listener on
        `server` runs a dialler on `client` (its argv after the listener's own)."""
        dial = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)"
        listen = (
            "import socket, subprocess, sys\n"
            "listener = socket.create_server((sys.argv[1], 0))\n"
            "port = str(listener.getsockname()[1])\n"
            "subprocess.run([*sys.argv[2:], sys.argv[1], port], check=True)\n"
        )
        dialler = [*client.prefix, sys.executable, "-c", dial]
        try:
            sh(*server.prefix, sys.executable, "-c", listen, server.address, *dialler)
        except NetworkError as error:
            hint = "" if self.forward_rule else " (does iptables' FORWARD chain drop bridged packets?)"
            raise NetworkError(f"{client.netns} cannot reach {server.netns}{hint}: {error}") from None

    def check_reachable_from_here(self, server: Host) -> None:
        """Proves that the test process itself reaches `server` over the bridge (its packets could go to
        another bridge on the same subnet, were one there). It dials from this process: `check_reachable`'s
        dialler is the listener's child, so without a namespace of its own it would dial from `server`."""
        listen = (
            "import socket, sys\n"
            "listener = socket.create_server((sys.argv[1], 0))\n"
            "print(listener.getsockname()[1], flush=True)\n"
            "listener.settimeout(10)\n"
            "listener.accept()\n"
        )
        argv = [*server.prefix, sys.executable, "-c", listen, server.address]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as listener:
            try:
                assert listener.stdout is not None
                port = int(listener.stdout.readline())
                socket.create_connection((server.address, port), timeout=3).close()
            except (OSError, ValueError) as error:
                where = f"{server.netns} at {server.address}"
                raise NetworkError(f"this process cannot reach {where}: {error}") from None
            finally:
                listener.kill()

    def close(self) -> None:
        """Removes the namespaces (their veth pairs go with them), the bridge and the iptables rule."""
        for host in self.hosts:
            with contextlib.suppress(NetworkError):
                sh("ip", "netns", "del", host.netns)
        self.hosts = []
        with contextlib.suppress(NetworkError):
            sh("ip", "link", "del", self.bridge)
        if self.forward_rule is not None:
            with contextlib.suppress(NetworkError):
                sh("iptables", "-D", *self.forward_rule)
            self.forward_rule = None


@contextlib.contextmanager
def subnet_lock() -> Iterator[None]:
    """Held while a subnet is chosen and claimed, so that two test runs starting together pick two."""
    SUBNET_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with SUBNET_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_subnet(seed: int) -> str:
    """The first `10.231.N` (N in `SUBNETS`, starting from `seed`) that no address or route here covers."""
    taken = sh("ip", "-4", "-o", "addr", "show") + sh("ip", "-4", "route", "show", "table", "all")
    for step in range(len(SUBNETS)):
        subnet = f"10.231.{SUBNETS[(seed + step) % len(SUBNETS)]}"
        if f"{subnet}." not in taken:
            return subnet
    every = f"10.231.{SUBNETS.start}-{SUBNETS.stop - 1}.0/24"
    raise NetworkError(f"every subnet {every} is in use on this machine")
