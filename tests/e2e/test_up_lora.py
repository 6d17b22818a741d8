"""`rlfabric up --lora 16` on the built-in demo, with real processes: the learner trains LoRA adapters only,
publishes each version as the adapter alone, the vLLM replica serves it beside the base, the held-out
reward rises, and the books balance."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from learning import assert_learned

from rlfabric.tools import ledger

STEPS = 16


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]) -> Path:
    run_dir = tmp_path_factory.mktemp("up-lora")
    argv = ["up", "--run-dir", str(run_dir), "--steps", str(STEPS), "--lora", "16", "--no-progress"]
    result = subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", *argv],
        env={**vllm_env, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    (run_dir / "up.out").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "demo" / "metrics.jsonl").read_text().splitlines()]


def test_the_run_trained_adapters_and_learned(lora_run: Path) -> None:
    state = json.loads((lora_run / "up.json").read_text())
    assert state["spec"]["model"]["lora"]["rank"] == 16
    series = rows(lora_run)
    assert [r["step"] for r in series] == list(range(1, STEPS + 1))
    assert_learned(series, "demo")
    assert series[-1]["kl"] > 0  # the reference (the adapters off) and the policy differ


def test_published_versions_are_adapters_that_the_replica_served(lora_run: Path) -> None:
    """The weight store holds the adapter alone per version (PEFT's names, a few hundred KB, not the
    model), and the replica loaded them: its log names the adapter versions it served."""
    from rlfabric.weights import adapters
    from rlfabric.weights import versions as store

    root = str(lora_run / "demo" / "weights")
    published = [v.version for v in store.list_versions(root) if v.committed]
    assert published, "no version published"
    for version in published:
        manifest = store.read_manifest(root, version)
        assert adapters.is_adapter_version(manifest)
        assert manifest.tensors and all(".lora_" in name for name in manifest.tensors)
        assert manifest.total_bytes < 2_000_000
    log = "".join(p.read_text() for p in (lora_run / "logs").glob("rollout-*.log"))
    assert f"serving adapter demo version {published[-1]}" in log


def test_books_balance(lora_run: Path, reopen_aof: Callable[[Path], redis.Redis]) -> None:
    books = reopen_aof(lora_run)
    run = lora_run / "demo"
    result = ledger.check(books, "demo", run / "checkpoints", weights_root=str(run / "weights"))
    assert result.count()[ledger.TRAINED] == STEPS * 8
