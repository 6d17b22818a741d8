"""`rlfabric up RUN_FILE` with `mode = "offline_preference"` and each loss beyond DPO (KTO on labelled
rows, ORPO and SimPO on pairs) on the tiny model, with real processes (redis-server, learner,
coordinator): the run completes, and every step's metrics row, in metrics.jsonl and in the run's metrics
stream, carries the loss's own statistics. `test_up_dpo.py` audits the rest of the run (checkpoints, no
prompt dispatched) once for all losses.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from rlfabric.contracts import keys
from rlfabric.contracts.metrics import decode_row

STEPS = 2
PAIRS = [{"prompt": f"is {i} a number?", "chosen": "yes", "rejected": "no"} for i in range(8)]
ROWS = [
    {"prompt": f"is {i} a number?", "completion": "yes" if i % 2 else "no", "label": i % 2 == 1}
    for i in range(8)
]
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any], tuple[str, ...]]] = {
    "kto": (
        ROWS,
        {"loss": "kto", "kto_desirable_weight": 1.2},
        ("kl", "rewards_chosen", "rewards_rejected", "desirable"),
    ),
    "orpo": (PAIRS, {"loss": "orpo", "orpo_lambda": 0.2}, ("nll_loss", "odds_ratio_loss", "reward_accuracy")),
    "simpo": (
        PAIRS,
        {"loss": "simpo", "simpo_gamma": 1.0},
        ("rewards_chosen", "reward_margin", "reward_accuracy"),
    ),
}
"""Per loss: the dataset, the `[preference]` section, and the statistics every metrics row must carry."""


@pytest.mark.parametrize("loss", sorted(CASES))
def test_each_loss_trains_through_up(
    loss: str, tmp_path: Path, tiny_model_dir: Path, reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    rows, section, stats = CASES[loss]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_file = tmp_path / f"{loss}.yaml"
    run = {
        "name": loss,
        "mode": "offline_preference",
        "model": {"path": str(tiny_model_dir), "max_model_len": 64},
        "dataset": {"path": str(data)},
        "preference": section,
        "optim": {"lr": 1e-3},
        "train": {"steps": STEPS, "groups_per_step": 4, "micro_batch_size": 2, "checkpoint_every": 2},
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
    local = [json.loads(line) for line in (run_dir / loss / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in local] == list(range(1, STEPS + 1))
    for row in local:
        assert all(math.isfinite(row[name]) for name in ("loss", *stats)), row
    assert local[-1]["loss"] < local[0]["loss"]
    books = reopen_aof(run_dir)
    streamed = [decode_row(fields) for _, fields in books.xrange(keys.metrics(loss))]
    assert [r["step"] for r in streamed] == list(range(1, STEPS + 1))
    assert all(name in streamed[-1] for name in stats), streamed[-1]
    assert books.hget(keys.run(loss), "state") == b"completed"
