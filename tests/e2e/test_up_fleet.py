"""`rlfabric up --runs 2 --lora 16` on the built-in demo, with real processes: two runs share one rollout
fleet of a single vLLM replica (`fleet=local`), each with its own learner training LoRA adapters; the one
replica serves both runs' adapters, both runs learn (reward and held-out reward rise), and each run's books
balance."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from learning import assert_learned

from rlfabric.contracts import keys
from rlfabric.tools import ledger

STEPS = 16
RUNS = ("demo-1", "demo-2")


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]) -> Path:
    run_dir = tmp_path_factory.mktemp("up-fleet")
    argv = ["up", "--runs", "2", "--run-dir", str(run_dir), "--steps", str(STEPS), "--lora", "16"]
    result = subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", *argv, "--no-progress"],
        env={**vllm_env, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    (run_dir / "up.out").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return run_dir


def rows(run_dir: Path, run: str) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("run", RUNS)
def test_each_run_trained_its_adapters_and_learned(fleet_run: Path, run: str) -> None:
    series = rows(fleet_run, run)
    assert [r["step"] for r in series] == list(range(1, STEPS + 1))
    assert_learned(series, run)
    assert series[-1]["kl"] > 0


def test_one_replica_of_the_fleet_served_both_runs(fleet_run: Path) -> None:
    """Only one replica ran, following the fleet rather than a run, and it loaded the adapter versions of
    both runs (its log names each, with the fleet)."""
    logs = sorted(p.name for p in (fleet_run / "logs").glob("rollout-*.log"))
    assert logs == ["rollout-0.log"], logs
    log = (fleet_run / "logs" / "rollout-0.log").read_text()
    for run in RUNS:
        assert re.search(rf"serving adapter {run} version \d+ \(run {run} of fleet local\)", log), run


def test_both_runs_generated_on_the_one_replica(
    fleet_run: Path, reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    """Every group each run's learner trained came from that replica, and both runs' groups were
    generated (the coordinator's counters)."""
    books = reopen_aof(fleet_run)
    for run in RUNS:
        generated = int(books.hget(keys.counters(run), keys.Counter.SAMPLES_GENERATED) or 0)
        assert generated >= STEPS * 8 * 8, (run, generated)
        replicas = {
            sample.replica_id
            for _, fields in books.xrange(keys.groups(run))
            for sample in decode(fields).samples
        }
        assert replicas <= {"rollout-0"}, (run, replicas)


def decode(fields: dict[bytes, bytes]) -> object:
    from rlfabric.contracts import wire

    return wire.decode_group(fields[b"data"])


@pytest.mark.parametrize("run", RUNS)
def test_books_balance_for_each_run(
    fleet_run: Path, run: str, reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    books = reopen_aof(fleet_run)
    folder = fleet_run / run
    result = ledger.check(books, run, folder / "checkpoints", weights_root=str(folder / "weights"))
    assert result.count()[ledger.TRAINED] == STEPS * 8
