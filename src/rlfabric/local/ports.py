"""Ports for the services `rlfabric up` starts on this host, chosen before the services start.

A service's port is chosen up front so that a restarted service binds the same one. It is drawn below the
kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), from which every bind to port 0 and
every outgoing connection takes its local port: a port from that range, free when chosen, can be taken by
one of those before the service binds it. (Seen: four learners starting together, one learner's /metrics
server, bound to port 0, got the port chosen for another learner's gRPC server, which then failed to start.)
Below that range only another explicit choice can take it: ports handed out in this process are not handed
out again, and a port is handed out only if it binds now.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FLOOR = 20000
"""The lowest port handed out (clear of the registered ports most services use)."""
DEFAULT_EPHEMERAL_START = 32768
"""Linux's default start of the ephemeral range, where the file cannot be read."""
TRIES = 200

_lock = threading.Lock()
_handed_out: set[int] = set()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def binds(port: int) -> bool:
    """Whether a listener could bind `port` on loopback now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now on loopback, below the ephemeral range and not handed out before by this process;
    an ephemeral one (the kernel's choice) where no such range is left or none of `TRIES` draws binds."""
    with _lock:
        top = ephemeral_start()
        if top - FLOOR >= TRIES:
            for _ in range(TRIES):
                port = random.randrange(FLOOR, top)
                if port not in _handed_out and binds(port):
                    _handed_out.add(port)
                    return port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
