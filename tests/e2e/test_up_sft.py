"""`rlfabric up RUN_FILE` with `mode = "sft"` on the tiny model, through the CLI: only the learner runs
(no Redis, coordinator, rollout or reward process), the run completes with its metrics and its final
model, and `up --resume` of the finished run trains nothing and exits 0."""

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


def test_sft_runs_through_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "sft.jsonl"
    chats = [
        [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]
        for i in range(8)
    ]
    rows = [{"messages": chat} for chat in chats]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_file = tmp_path / "sft.yaml"
    run = {
        "name": "sft",
        "mode": "sft",
        "model": {"path": str(tiny_model_dir), "max_model_len": 64},
        "dataset": {"path": str(data)},
        "optim": {"lr": 1e-3},
        "train": {"steps": STEPS, "groups_per_step": 2, "micro_batch_size": 2, "checkpoint_every": 2},
    }
    run_file.write_text(yaml.safe_dump(run))
    run_dir = tmp_path / "run"
    result = up(str(run_file), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["learner-sft.log"]
    metrics = [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert is_committed(final_model_dir(run_dir / "sft"))

    again = up("--resume", str(run_dir))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len((run_dir / "sft" / "metrics.jsonl").read_text().splitlines()) == STEPS
