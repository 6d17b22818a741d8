"""`rlfabric serve reward --set processes=2`: several server processes behind one port, as users run it.

Proves that connections reach both processes, that the supervisor replaces a process that dies while the
service keeps answering, that its /metrics sums the processes' counters, that every process (a replaced
one too) requires the service's token, and that SIGTERM stops every process.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rlfabric.local.procs import ServiceProcess
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

PROCESSES = 2
TOKEN = "reward-processes-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def server_children(pid: int) -> list[int]:
    """The supervisor's live child processes (its reward servers)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children += [int(c) for c in (task / "children").read_text().split()]
    return sorted(children)


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[ServiceProcess, str, str]]:
    proc = ServiceProcess(
        "reward",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0",
            "--set", f"processes={PROCESSES}", "--set", "workers=2", "--set", "server.metrics_port=0",
            "--set", "server.grace_period_s=2", "--set", "log.format=text",
        ],
        log_path=tmp_path / "reward.log",
        env={**os.environ, "RLFABRIC_REWARD__TOKEN": TOKEN},
    )  # fmt: skip
    metrics = proc.start(r"metrics on (http://\S+)", timeout_s=60).group(1)
    address = proc.wait_for(r"listening on (\S+) \(2 processes\)", timeout_s=120).group(1)
    try:
        yield proc, address, metrics
    finally:
        proc.stop()


def score_over_connections(address: str, connections: int, calls_each: int) -> int:
    """`calls_each` exact_match calls of 64 items on each of `connections` separate connections; returns
    the items answered OK. Each connection's first call, made without the token, must be refused."""
    request = reward_pb2.ScoreRequest(
        scorer=reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name="exact_match")),
        items=[reward_pb2.ScoreItem(id=str(i), completion="42", reference="42") for i in range(64)],
    )
    ok = 0
    for _ in range(connections):
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        with channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Score(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for _ in range(calls_each):
                response = stub.Score(request, timeout=30, metadata=AUTH)
                ok += sum(r.reward.value == 1.0 for r in response.results)
    return ok


def test_connections_spread_over_processes_and_metrics_sum(
    service: tuple[ServiceProcess, str, str],
) -> None:
    proc, address, metrics = service
    children = server_children(proc.pid)
    assert len(children) == PROCESSES
    before = {pid: cpu_ticks(pid) for pid in children}

    assert score_over_connections(address, connections=24, calls_each=20) == 24 * 20 * 64

    # Each process did a real share of the work (an idle one only ticks for gRPC's background threads).
    # Of 24 connections, fewer than 3 land on one process with probability ~4e-5 per run.
    used = [cpu_ticks(pid) - before[pid] for pid in children]
    assert min(used) >= 0.1 * sum(used), f"CPU ticks per process: {used}"
    body = urllib.request.urlopen(f"{metrics}/metrics", timeout=10).read().decode()
    counted = re.search(r'rlfabric_reward_items_total\{scorer="exact_match",status="ok"\} (\S+)', body)
    assert counted is not None and float(counted.group(1)) == 24 * 20 * 64


def test_a_dead_process_is_replaced_and_sigterm_stops_all(service: tuple[ServiceProcess, str, str]) -> None:
    proc, address, _ = service
    first, second = server_children(proc.pid)
    os.kill(first, signal.SIGKILL)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        first in server_children(proc.pid) or len(server_children(proc.pid)) < PROCESSES
    ):
        time.sleep(0.2)
    replaced = server_children(proc.pid)
    assert len(replaced) == PROCESSES and first not in replaced and second in replaced
    assert score_over_connections(address, connections=8, calls_each=2) == 8 * 2 * 64

    assert proc.stop() == 0
    assert not [pid for pid in replaced if Path(f"/proc/{pid}").exists()]
