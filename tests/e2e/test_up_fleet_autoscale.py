"""`rlfabric up --runs 2 --lora 16 --max-replicas 2` with real processes: two LoRA runs on one shared fleet,
whose desired-replica signal (summed over its runs, `keys.fleet_scaling`) asks for a second vLLM replica
while the first is saturated; `up` starts it mid-run, it joins the fleet, loads both runs' adapters and
receives work from the runs; both runs are stopped through the REST API and each run's books balance.

As in tests/e2e/test_up_autoscale.py (one run, the transformers engine), the runs are given far more steps
than they need and stopped a fixed number of steps after both see the second replica serving them, and a
low target busy fraction makes the rule ask for it early whatever the machine's speed.
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

RUNS = ("demo-1", "demo-2")
MAX_STEPS = 300
"""A bound the runs never reach: the test stops them."""
STEPS_WITH_TWO = 4
"""Steps each run trains after both runs' pools saw the second replica, before the stop."""
TIMEOUT_S = 1200.0


@pytest.fixture(scope="module")
def scaled_fleet(tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]) -> Path:
    run_dir = tmp_path_factory.mktemp("up-fleet-scale")
    out = run_dir / "up.out"
    argv = [
        sys.executable,
        "-m",
        "rlfabric.cli",
        "up",
        "--runs",
        "2",
        "--lora",
        "16",
        "--run-dir",
        str(run_dir),
    ]
    argv += ["--steps", str(MAX_STEPS), "--no-progress", "--max-replicas", "2", "--scale-up-after", "2"]
    # a low target makes the rule ask for a second replica as soon as the first is a third busy
    env = {**vllm_env, "PYTHONUNBUFFERED": "1", "RLFABRIC_COORDINATOR__SCALING__TARGET_BUSY_FRACTION": "0.3"}
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        page = wait_for(
            "the runs' pages", proc, out,
            lambda: re.search(r"page: (http://\S+)/runs/demo-2", out.read_text()), TIMEOUT_S,
        )  # fmt: skip
        url, headers = page.group(1), bearer(run_dir)

        def steps_with_two() -> dict[str, int] | None:
            found = {run: run_status(url, headers, run) for run in RUNS}
            if all((s.get("scaling") or {}).get("replicas") == 2 for s in found.values()):
                return {run: int(s.get("step") or 0) for run, s in found.items()}
            return None

        seen_at = wait_for("the second replica serving both runs", proc, out, steps_with_two, TIMEOUT_S)
        for run in RUNS:
            target = seen_at[run] + STEPS_WITH_TWO
            wait_for(
                f"{run} step {target}", proc, out,
                lambda run=run, target=target: int(run_status(url, headers, run).get("step") or 0) >= target,
                TIMEOUT_S,
            )  # fmt: skip
        for run in RUNS:
            httpx.post(f"{url}/v1/runs/{run}/stop", headers=headers, timeout=10).raise_for_status()
        returncode = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:  # a failed wait: stop `up` (it stops its services) before failing
            proc.terminate()
            proc.wait(timeout=120)
    output = out.read_text()
    assert returncode == 1 and all(f"run {run}: stopped at step" in output for run in RUNS), output[-4000:]
    return run_dir


@pytest.fixture(scope="module")
def books(scaled_fleet: Path, reopen_aof: Callable[[Path], redis.Redis]) -> redis.Redis:
    """The runs' Redis, reopened from its AOF after `up` stopped it."""
    return reopen_aof(scaled_fleet)


def test_up_added_a_fleet_replica_that_served_the_runs(scaled_fleet: Path, books: redis.Redis) -> None:
    output = (scaled_fleet / "up.out").read_text()
    assert "autoscale: adding rollout-1 (1 running, 2 wanted)" in output, output[-4000:]
    assert "autoscaling: 1 added, 0 removed, 0 failed to start" in output, output[-4000:]
    served: dict[str, set[str]] = {}
    for run in RUNS:
        for _, fields in books.xrange(keys.groups(run)):
            group = queue_pb2.ScoredGroup.FromString(fields[b"data"])
            served.setdefault(run, set()).update(s.replica_id for s in group.samples)
    assert set.union(*served.values()) == {"rollout-0", "rollout-1"}, served


@pytest.mark.parametrize("run", RUNS)
def test_books_balance_for_each_run(scaled_fleet: Path, books: redis.Redis, run: str) -> None:
    folder = scaled_fleet / run
    result = ledger.check(books, run, folder / "checkpoints", weights_root=str(folder / "weights"))
    trained = result.count()[ledger.TRAINED]
    assert books.hget(f"rlfabric:{run}:counters", "groups_trained") == str(trained).encode()
    output = (scaled_fleet / "up.out").read_text()
    stopped_at = int(re.search(rf"run {run}: stopped at step (\d+)", output)[1])
    assert trained >= stopped_at * 8 > 0
