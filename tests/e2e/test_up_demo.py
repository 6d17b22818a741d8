"""`rlfabric up` on the built-in demo, with real processes (redis-server, reward, vLLM rollout, learner,
coordinator): the reward rises, and afterwards the books balance (`rlfabric.tools.ledger`) from the run's
own Redis (AOF) and the learner's checkpoint: every drawn prompt was enqueued once, dropped with a reason,
or is still in flight; no group was trained twice; every trained group was enqueued.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from rlfabric.tools import ledger

STEPS = 12


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]) -> Path:
    run_dir = tmp_path_factory.mktemp("up")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlfabric.cli",
            "up",
            "--run-dir",
            str(run_dir),
            "--steps",
            str(STEPS),
            "--no-progress",
        ],
        env={**vllm_env, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    (run_dir / "up.out").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def books(demo_run: Path, reopen_aof: Callable[[Path], redis.Redis]) -> redis.Redis:
    """The run's Redis, reopened from its AOF after `up` stopped it."""
    return reopen_aof(demo_run)


def rows(demo_run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (demo_run / "demo" / "metrics.jsonl").read_text().splitlines()]


def test_reward_rises_and_metrics_rows_are_complete(demo_run: Path) -> None:
    series = rows(demo_run)
    assert [r["step"] for r in series] == list(range(1, STEPS + 1))
    for row in series:
        assert {"step", "policy_version", "reward_mean", "kl", "entropy", "tokens_per_s"} <= row.keys()
    first = sum(r["reward_mean"] for r in series[:3]) / 3
    last = sum(r["reward_mean"] for r in series[-3:]) / 3
    assert last > first + 0.1, (first, last)
    evaluated = [r for r in series if "eval_reward_mean" in r]
    final = series[-1]  # the last row waited for the held-out evaluation of the policy the run ends with
    assert (final["eval_step"], final["eval_policy_version"]) == (STEPS, final["policy_version"]), final
    start = evaluated[0]  # `up`'s summary: the first and the final held-out reward
    line = f"held-out reward: {start['eval_reward_mean']:.3f} at step {start['eval_step']} -> "
    assert f"{line}{final['eval_reward_mean']:.3f} at step {STEPS}\n" in (demo_run / "up.out").read_text()
    assert (demo_run / "demo" / "curves.png").exists()


def test_the_final_model_is_the_last_published_policy_as_a_hugging_face_folder(demo_run: Path) -> None:
    """What a user takes away: `<run>/model` loads with transformers, tokenizer and chat template
    included, and holds the weights of the last version the replicas served."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfabric.weights import versions

    final = demo_run / "demo" / "model"
    assert f"final model: {final} " in (demo_run / "up.out").read_text()
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(final).chat_template
    root = str(demo_run / "demo" / "weights")
    latest = versions.latest_committed(root)
    assert latest is not None
    published = versions.load_version(root, latest)
    weights = model.state_dict()
    assert published and published.keys() <= weights.keys()
    for name, tensor in published.items():
        torch.testing.assert_close(weights[name], tensor.to(weights[name].dtype), rtol=0, atol=0, msg=name)


def test_books_balance(demo_run: Path, books: redis.Redis) -> None:
    """Every drawn prompt enqueued once, dropped with a reason or still in flight; no group trained twice;
    each trained group enqueued; versions increasing and published (`rlfabric.tools.ledger`)."""
    run = demo_run / "demo"
    result = ledger.check(books, "demo", run / "checkpoints", weights_root=str(run / "weights"))
    assert result.count()[ledger.TRAINED] == STEPS * 8  # the step budget spent, each group once
