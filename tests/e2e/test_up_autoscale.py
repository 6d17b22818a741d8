"""`rlfabric up --max-replicas 2` with real processes: the run's desired-replica signal asks for a
second replica while the first is saturated, `up` starts it mid-run, it receives work (trained samples
carry its replica id) once it holds a published version, the run is stopped through the REST API while
both replicas work, and afterwards the books balance from the run's own Redis (AOF) and the learner's
checkpoint.

The run is not timed: it is given far more steps than it needs and stopped a fixed number of steps after
the coordinator's pool sees the second replica, so a fast learner cannot end it before the new replica
had work (a replica takes ~10 s to start on two cores; 24 steps once took less). The coordinator's
target busy fraction is set low, so that the rule asks for a second replica early whatever the machine's
speed. The transformers reference engine keeps replica start-up short on two cores; the scaling path
(signal, scaler, registry, dispatch) is the same for vLLM replicas.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
from up_watch import bearer, run_status, wait_for

from rlfabric.contracts import keys
from rlfabric.tools import ledger
from rlfabric.v1 import queue_pb2

MAX_STEPS = 300
"""A bound the run never reaches: the test stops it."""
STEPS_WITH_TWO = 6
"""Steps trained after the pool saw both replicas, before the stop (each step dispatches 8 groups,
least loaded first, so the new replica gets about half of them)."""
TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def scaled_run(tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]) -> Path:
    run_dir = tmp_path_factory.mktemp("up-scale")
    out = run_dir / "up.out"
    argv = [sys.executable, "-m", "rlfabric.cli", "up", "--run-dir", str(run_dir), "--steps", str(MAX_STEPS)]
    argv += ["--no-progress", "--engine", "transformers", "--max-replicas", "2", "--scale-up-after", "2"]
    # a low target makes the rule ask for a second replica as soon as the first is a third busy
    env = {**vllm_env, "PYTHONUNBUFFERED": "1", "RLFABRIC_COORDINATOR__SCALING__TARGET_BUSY_FRACTION": "0.3"}
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        page = wait_for(
            "the run's page", proc, out,
            lambda: re.search(r"page: (http://\S+)/runs/demo", out.read_text()), TIMEOUT_S,
        )  # fmt: skip
        url, headers = page.group(1), bearer(run_dir)

        def step_with_two() -> int | None:
            status = run_status(url, headers, "demo")
            scaling = status.get("scaling") or {}
            return int(status["step"] or 0) + 1 if status and scaling.get("replicas") == 2 else None

        seen_at = wait_for("a second replica in the pool", proc, out, step_with_two, TIMEOUT_S)
        wait_for(
            f"step {seen_at + STEPS_WITH_TWO}", proc, out,
            lambda: int(run_status(url, headers, "demo").get("step") or 0) >= seen_at + STEPS_WITH_TWO,
            TIMEOUT_S,
        )  # fmt: skip
        httpx.post(f"{url}/v1/runs/demo/stop", headers=headers, timeout=10).raise_for_status()
        returncode = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:  # a failed wait: stop `up` (it stops its services) before failing
            proc.terminate()
            proc.wait(timeout=120)
    output = out.read_text()
    # a stopped run ends `up` with 1; the summary says how it ended
    assert returncode == 1 and "run demo: stopped at step" in output, output[-3000:]
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
    for _, fields in books.xrange(keys.groups("demo")):
        group = queue_pb2.ScoredGroup.FromString(fields[b"data"])
        replicas |= {s.replica_id for s in group.samples}
    assert replicas == {"rollout-0", "rollout-1"}


def test_books_balance_after_scaling(scaled_run: Path, books: redis.Redis) -> None:
    run = scaled_run / "demo"
    result = ledger.check(books, "demo", run / "checkpoints", weights_root=str(run / "weights"))
    trained = result.count()[ledger.TRAINED]
    assert books.hget("rlfabric:demo:counters", "groups_trained") == str(trained).encode()
    stopped_at = int(re.search(r"run demo: stopped at step (\d+)", (scaled_run / "up.out").read_text())[1])
    assert trained >= stopped_at * 8 > 0
