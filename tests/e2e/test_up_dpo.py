"""`rlfabric up RUN_FILE` with `mode = "offline_preference"` (DPO) on the tiny model, with real processes
(redis-server, learner, coordinator): the coordinator dispatches no prompt, the learner trains the run and
reports each step through Redis, the run completes, checkpoints and published weights are written, and
the run's metrics stream (what the run page and `runs status` read) holds every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import redis
import yaml
from transformers import AutoConfig

from rlfabric.contracts import keys
from rlfabric.contracts.keys import Counter
from rlfabric.contracts.metrics import decode_row
from rlfabric.learner.checkpoint import latest_complete
from rlfabric.learner.export import final_model_dir, is_committed

STEPS = 3


def test_dpo_runs_through_up(
    tmp_path: Path, tiny_model_dir: Path, reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    data = tmp_path / "prefs.jsonl"
    pairs = [{"prompt": f"is {i} a number?", "chosen": "yes", "rejected": "no"} for i in range(8)]
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    run_file = tmp_path / "dpo.yaml"
    run = {
        "name": "dpo",
        "mode": "offline_preference",
        "model": {"path": str(tiny_model_dir), "max_model_len": 64},
        "dataset": {"path": str(data)},
        "optim": {"lr": 1e-3},
        "train": {"steps": STEPS, "groups_per_step": 2, "micro_batch_size": 2, "checkpoint_every": 2},
    }
    run_file.write_text(yaml.safe_dump(run))
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "rlfabric.cli",
        "up",
        str(run_file),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    (tmp_path / "up.out").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        not (run_dir / "logs" / "rollout-0.log").exists() and not (run_dir / "logs" / "reward.log").exists()
    )
    local = [json.loads(line) for line in (run_dir / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in local] == list(range(1, STEPS + 1))
    assert latest_complete(run_dir / "dpo" / "checkpoints") is not None
    final = final_model_dir(run_dir / "dpo")  # the trained policy as a Hugging Face folder
    assert is_committed(final)
    assert AutoConfig.from_pretrained(final).architectures == ["Qwen2ForCausalLM"]
    books = reopen_aof(run_dir)
    streamed = [decode_row(fields) for _, fields in books.xrange(keys.metrics("dpo"))]
    assert [r["step"] for r in streamed] == list(range(1, STEPS + 1)) and "policy_version" in streamed[-1]
    assert int(books.get(keys.step("dpo")) or 0) == STEPS
    assert int(books.hget(keys.counters("dpo"), Counter.PROMPTS_DISPATCHED) or 0) == 0
    assert books.hget(keys.run("dpo"), "state") == b"completed"
