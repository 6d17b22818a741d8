"""`rlfabric serve reward` with `processes` > 1: several server processes behind one port.

One Python process answers RPCs on one core at most: gRPC's per-call work, the proto conversions and the
inline scorers all hold its GIL. For cheap scorers at high call rates that core, not the scoring, is the
limit. The supervisor here lifts it the way a web server's pre-fork model does:

1. reserve the port: bind (host, port) with SO_REUSEPORT without listening (port 0 picks a free one).
   A socket that does not listen never receives a connection; it only keeps the port for the children;
2. start `processes` children (new interpreters, never forks: gRPC does not survive a fork; the config
   goes as JSON on their stdin, no pickle), each a complete reward server with its share of the scorer
   workers, bound to that port with SO_REUSEPORT: the kernel spreads incoming connections over them;
3. watch: a child that dies is replaced (a crash loop, more than `MAX_RESTARTS` in a minute, stops the
   service); SIGTERM or SIGINT stops every child gracefully, then the supervisor exits.

Unless `server.metrics_port` is -1 (off), the children write their metrics to a shared directory
(prometheus_client's multiprocess mode) and the supervisor serves the sum on that port.
"""

from __future__ import annotations

import logging
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from rlfabric.reward.config import RewardServiceConfig
from rlfabric.runtime.schema import METRICS_OFF

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""A child that has not bound its port by then fails the start."""
STOP_SLACK_S = 5.0
"""Beyond the server's grace period, how long a stopping child may take before it is killed."""
RESTART_DELAY_S = 1.0
MAX_RESTARTS = 5
"""Replacements allowed within a minute; one more means the children crash on start, so stop."""
WATCH_INTERVAL_S = 0.5


class Stop(Exception):
    """A signal asked the supervisor to stop."""


def supervise(config: RewardServiceConfig) -> int:
    """Runs `config.processes` reward servers on one port until a signal stops them; the exit status."""
    metrics_dir = _share_metrics(config)
    try:
        with reserved_port(config.server.host, config.server.port) as port:
            supervisor = Supervisor(child_config(config, port), config.processes)
            return supervisor.run()
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def child_config(config: RewardServiceConfig, port: int) -> RewardServiceConfig:
    """One child's config: the reserved port, one process, its share of the workers, no metrics port of
    its own (the supervisor serves the children's metrics)."""
    server = config.server.model_copy(update={"port": port, "metrics_port": METRICS_OFF})
    workers = math.ceil(config.workers / config.processes)
    return config.model_copy(update={"server": server, "processes": 1, "workers": workers})


@contextmanager
def reserved_port(host: str, port: int) -> Iterator[int]:
    """Holds (host, port) with SO_REUSEPORT, not listening, and yields the port (port 0 picks one)."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


def _share_metrics(config: RewardServiceConfig) -> str | None:
    """With a metrics port: a directory for the children's metrics, exported to them through the
    environment, and the supervisor's /metrics server summing it. Returns the directory."""
    if config.server.metrics_port == METRICS_OFF:
        return None
    from rlfabric.runtime.metrics import serve_metrics

    directory = tempfile.mkdtemp(prefix="rlfabric-reward-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # spawned children inherit it
    serve_metrics("reward", config.server)
    return directory


def child_main() -> int:
    """A child process (`python -m rlfabric.reward.supervisor`): one reward server on the shared port,
    its config as JSON on stdin. Once bound it writes "ready PORT" on stdout, then points stdout at
    stderr (nobody reads the pipe any more)."""
    from rlfabric.reward.main import serve_one

    def ready(port: int) -> None:
        sys.stdout.write(f"ready {port}\n")
        sys.stdout.flush()
        os.dup2(2, 1)

    serve_one(RewardServiceConfig.model_validate_json(sys.stdin.read()), reuse_port=True, on_ready=ready)
    return 0


class Supervisor:
    """Starts, watches, replaces and stops the children (slots 0..count-1)."""

    def __init__(self, child: RewardServiceConfig, count: int) -> None:
        self.child = child
        self.count = count
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: list[float] = []

    def run(self) -> int:
        """Start every child, announce the address, watch until a signal; stop every child."""
        previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for slot in range(self.count):
                self.start(slot)
            self.wait_ready(list(self.children))
            host, port = self.child.server.host, self.child.server.port
            print(f"rlfabric reward service listening on {host}:{port} ({self.count} processes)", flush=True)
            return self.watch()
        except Stop:
            return 0
        finally:
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not orphan the children
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def start(self, slot: int) -> None:
        """Starts the child of `slot`, its config on its stdin."""
        child = subprocess.Popen(
            [sys.executable, "-m", "rlfabric.reward.supervisor"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert child.stdin is not None
        child.stdin.write(self.child.model_dump_json().encode())
        child.stdin.close()
        self.children[slot] = child
        log.info("reward server process started", extra={"slot": slot, "pid": child.pid})

    def wait_ready(self, slots: list[int]) -> None:
        """Waits until each child of `slots` has bound the port; raises if one exits or takes too long."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot in slots:
            stdout = self.children[slot].stdout
            assert stdout is not None
            readable, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = stdout.readline() if readable else b""
            stdout.close()
            if not line.startswith(b"ready "):
                raise RuntimeError(f"reward server process {slot} did not start (see its log above)")

    def watch(self) -> int:
        """Replaces children that die; returns 1 on a crash loop (returns otherwise only by `Stop`)."""
        while True:
            time.sleep(WATCH_INTERVAL_S)
            for slot, child in list(self.children.items()):
                if child.poll() is None:
                    continue
                _forget_metrics(child.pid)
                log.warning(
                    "reward server process exited; replacing it",
                    extra={"slot": slot, "pid": child.pid, "exitcode": child.returncode},
                )
                if not self.may_restart():
                    log.error(
                        "reward server processes keep exiting; stopping", extra={"restarts": MAX_RESTARTS}
                    )
                    return 1
                time.sleep(RESTART_DELAY_S)
                self.start(slot)
                self.wait_ready([slot])

    def may_restart(self) -> bool:
        """Records a restart; False when more than MAX_RESTARTS happened within the last minute."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < 60.0] + [now]
        return len(self.restarts) <= MAX_RESTARTS

    def stop_all(self) -> None:
        """SIGTERM every child (a graceful server stop), then kill any still running after the grace."""
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + self.child.server.grace_period_s + STOP_SLACK_S
        for child in self.children.values():
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("reward server process did not stop; killing it", extra={"pid": child.pid})
                child.kill()
                child.wait()
            _forget_metrics(child.pid)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def _forget_metrics(pid: int) -> None:
    """Drops a dead child's live gauges from the shared metrics (its counters stay in the sums)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


if __name__ == "__main__":
    sys.exit(child_main())
