"""`rlfabric up --max-replicas 2` with real processes: the run's desired-replica signal asks for a
second replica while the first is saturated, `up` starts it mid-run, it receives work (trained samples
carry its replica id) once it holds a published version, and afterwards the books balance from the run's
own Redis (AOF) and the learner's checkpoint.

The coordinator's target busy fraction is set low, so that the rule asks for a second replica early in a
short run whatever the machine's speed. The transformers reference engine keeps replica start-up short
enough for a short run on two cores; the scaling path (signal, scaler, registry, dispatch) is the same
for vLLM replicas.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from rlfabric.common import ledger
from rlfabric.common.streams import groups_key
from rlfabric.v1 import queue_pb2

STEPS = 24


@pytest.fixture(scope="module")
def scaled_run(tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]) -> Path:
    run_dir = tmp_path_factory.mktemp("up-scale")
    argv = [sys.executable, "-m", "rlfabric.cli", "up", "--run-dir", str(run_dir), "--steps", str(STEPS)]
    argv += ["--no-progress", "--engine", "transformers", "--max-replicas", "2", "--scale-up-after", "2"]
    # a low target makes the rule ask for a second replica as soon as the first is a third busy
    env = {**vllm_env, "PYTHONUNBUFFERED": "1", "RLFABRIC_COORDINATOR__SCALING__TARGET_BUSY_FRACTION": "0.3"}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    (run_dir / "up.out").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def books(scaled_run: Path, reopen_aof: Callable[[Path], redis.Redis]) -> redis.Redis:
    """The run's Redis, reopened from its AOF after `up` stopped it."""
    return reopen_aof(scaled_run)


def test_up_added_a_replica_that_received_work(scaled_run: Path, books: redis.Redis) -> None:
    output = (scaled_run / "up.out").read_text()
    assert "autoscale: adding rollout-1 (1 running, 2 wanted)" in output, output[-3000:]
    assert "autoscaling: 1 added, 0 removed, 0 failed to start" in output, output[-3000:]
    replicas = set()
    for _, fields in books.xrange(groups_key("demo")):
        group = queue_pb2.ScoredGroup.FromString(fields[b"data"])
        replicas |= {s.replica_id for s in group.samples}
    assert replicas == {"rollout-0", "rollout-1"}


def test_books_balance_after_scaling(scaled_run: Path, books: redis.Redis) -> None:
    run = scaled_run / "demo"
    result = ledger.check(books, "demo", run / "checkpoints", weights_root=str(run / "weights"))
    assert result.count()[ledger.TRAINED] == STEPS * 8
    assert books.hget("rlfabric:demo:counters", "groups_trained") == str(STEPS * 8).encode()
