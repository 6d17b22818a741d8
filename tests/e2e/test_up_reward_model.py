"""`rlfabric up RUN_FILE` with `mode = "reward_model"` on the tiny model, through the CLI: only the
learner runs (no Redis, coordinator, rollout or reward process), the run completes with its metrics and a
sequence-classification model whose folder `up` prints, and `up --resume` of the finished run trains
nothing and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from rlfabric.learner.export import final_model_dir, is_committed

STEPS = 3


def up(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "rlfabric.cli", "up", *args, "--no-progress"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)


def test_a_reward_model_trains_through_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    rows = [  # TRL's conversational explicit-prompt form, with a margin column
        {"prompt": [{"role": "user", "content": f"q{i}"}], "chosen": [{"role": "assistant", "content": "xx"}],
         "rejected": [{"role": "assistant", "content": f"n{i}"}], "margin": 0.5}
        for i in range(12)
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_file = tmp_path / "rm.yaml"
    run = {
        "name": "rm",
        "mode": "reward_model",
        "model": {"path": str(tiny_model_dir), "max_model_len": 64},
        "dataset": {"path": str(data), "held_out_fraction": 0.25},
        "reward_model": {"margin_field": "margin", "center_rewards_coef": 0.01},
        "optim": {"lr": 1e-3},
        "train": {"steps": STEPS, "groups_per_step": 3, "micro_batch_size": 2, "checkpoint_every": 2},
    }
    run_file.write_text(yaml.safe_dump(run))
    run_dir = tmp_path / "run"
    result = up(str(run_file), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["learner-rm.log"]
    metrics = [json.loads(line) for line in (run_dir / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert "eval_accuracy" in metrics[-1]
    final = final_model_dir(run_dir / "rm")
    assert is_committed(final) and f"reward model {final}" in result.stdout
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1

    again = up("--resume", str(run_dir))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len((run_dir / "rm" / "metrics.jsonl").read_text().splitlines()) == STEPS
