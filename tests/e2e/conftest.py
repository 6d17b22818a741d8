"""Fixtures of the end-to-end tests: a finished run's Redis, reopened from its AOF for the audit."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from rlfabric.local.procs import ServiceProcess


@pytest.fixture(scope="module")
def reopen_aof(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[Path], redis.Redis]]:
    """`reopen(run_dir)`: a client of a redis-server started on `run_dir/redis` (the AOF `rlfabric up`
    left there); servers and clients are stopped when the module's tests are done."""
    opened: list[tuple[redis.Redis, ServiceProcess]] = []

    def reopen(run_dir: Path) -> redis.Redis:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        proc = ServiceProcess(
            "redis-audit",
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(run_dir / "redis"),
             "--appendonly", "yes", "--save", ""],
            log_path=tmp_path_factory.mktemp("audit") / "redis.log",
        )  # fmt: skip
        proc.start(r"Ready to accept connections", timeout_s=30)
        opened.append((redis.Redis(port=port), proc))
        return opened[-1][0]

    yield reopen
    for client, proc in opened:
        client.close()
        proc.stop()
