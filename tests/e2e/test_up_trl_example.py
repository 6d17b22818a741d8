"""`rlfabric up` on a user-style run file: examples/trl-reward.toml (reward functions written for TRL, a
local JSONL dataset with its own column names) with only the model (the tiny one), the sizes and the steps
changed. The run completes, every step's row has a reward, and what the functions logged (`log_metric`,
`log_extra`) is in the rows as `reward/<function>/<name>`.

The example names its files relative to the repository root, so the test lays them out the same way
under `tmp_path` (`examples/` with the function file and the prompts) and runs `up` from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 3
SMALL = {
    "rollout": {"sampling": {"n": 4, "max_tokens": 8}},
    "train": {"steps": STEPS, "groups_per_step": 2, "micro_batch_size": 8, "checkpoint_every": STEPS},
}
"""What changes besides the model: a few short samples, a few steps."""


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied table by table (a nested table is merged, not replaced)."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def derived_run_file(workdir: Path, model: Path) -> Path:
    """examples/trl-reward.toml with the tiny model and `SMALL`, its files copied beside it."""
    examples = workdir / "examples"
    examples.mkdir()
    for name in ("trl_rewards.py", "trl-prompts.jsonl"):
        shutil.copy(EXAMPLES / name, examples / name)
    example = tomllib.loads((EXAMPLES / "trl-reward.toml").read_text())
    run = merged(example, {"model": {"path": str(model), "max_model_len": 128}, **SMALL})
    path = examples / "trl-reward.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def test_the_trl_reward_example_runs_through_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_file = derived_run_file(tmp_path, tiny_model_dir)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "rlfabric.cli", "up", str(run_file.relative_to(tmp_path)),
            "--run-dir", str(run_dir), "--engine", "transformers", "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    (tmp_path / "up.out").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "trl-reward" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert isinstance(row["reward_mean"], float)
        assert {"reward/reward_func", "reward/length_curriculum_reward"} <= row.keys()
        assert row["reward/length_curriculum_reward/mean_chars"] >= 0.0  # log_metric
        assert "reward/length_curriculum_reward/chars" in row  # log_extra
