"""Every run file in examples/ passes `rlfabric config check` (the real CLI, in a subprocess, from the
repository root so the examples' relative paths resolve) with the full checks: the scorer is built (user
functions under the allow-list `rlfabric up` gives), local datasets are read with their split and their
columns checked, local models loaded. Hub ids cannot be fetched here: `config check` never downloads (a
hub model loads from the local cache only), lists what it did not check for them, and the test asserts
those lines, so a hub example is checked as far as it can be offline; `--schema-only` is not needed for any
of them. With HF_HUB_OFFLINE set, where the run could not download its model either, `config check`
refuses a hub model that is not cached, naming the field.

The [reward] fragment examples/reward-composite.toml is no run file: it is what `rlfabric reward score
--scorer FILE` takes, and is scored here on examples/math-completions.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FRAGMENTS = {"reward-composite.toml"}
"""Example TOML files that are not run files."""
RUN_FILES = sorted(p.name for p in EXAMPLES.glob("*.toml") if p.name not in FRAGMENTS)
QWEN_05B = ["model.path 'Qwen/Qwen2.5-0.5B-Instruct'"]
HUB_PARTS = {
    "gsm8k-math.toml": ["dataset.path 'openai/gsm8k' is a hub id", "model.path 'Qwen/Qwen3-0.6B'"],
    **{name: QWEN_05B for name in ("dpo-pairs.toml", "ppo-critic.toml", "sft-tools.toml", "trl-reward.toml")},
}
"""What `config check` says it could not check offline, per example naming hub ids."""


def rlfabric(*args: str, cwd: Path = ROOT, offline: bool = True) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess; `offline=False` unsets HF_HUB_OFFLINE (`config check` downloads nothing
    either way: it only decides whether a hub model missing from the cache is refused)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1" if offline else "0", "HF_DATASETS_OFFLINE": "1"}
    argv = [sys.executable, "-m", "rlfabric.cli", *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_examples_hold_each_kind_of_run() -> None:
    assert {"gsm8k-math.toml", "trl-reward.toml", "dpo-pairs.toml", "ppo-critic.toml"} <= set(RUN_FILES)


@pytest.mark.parametrize("name", RUN_FILES)
def test_each_example_run_file_passes_config_check(name: str) -> None:
    result = rlfabric("config", "check", f"examples/{name}", offline=name not in HUB_PARTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == f"examples/{name}: valid RunSpec"
    not_checked = [line for line in result.stdout.splitlines() if ": not checked: " in line]
    for part in HUB_PARTS.get(name, []):
        assert any(part in line for line in not_checked), result.stdout


@pytest.mark.parametrize("name", sorted(HUB_PARTS))
def test_a_hub_example_is_refused_where_its_model_cannot_be_downloaded(name: str) -> None:
    result = rlfabric("config", "check", f"examples/{name}")
    assert result.returncode == 2, result.stdout + result.stderr
    model = next(part for part in HUB_PARTS[name] if part.startswith("model.path")).split()[1]
    assert f"model.path: no folder {model} here" in result.stderr and "HF_HUB_OFFLINE is set" in result.stderr


def test_a_broken_copy_of_an_example_is_refused(tmp_path: Path) -> None:
    """The check is real: the TRL example with a misspelt function is refused naming the field (a copy of
    examples/ under `tmp_path`, checked from there as from the repository root)."""
    copy = shutil.copytree(EXAMPLES, tmp_path / "examples")
    run_file = copy / "trl-reward.toml"
    run_file.write_text(run_file.read_text().replace(":math_reward_func", ":math_reward_fn"))
    result = rlfabric("config", "check", "examples/trl-reward.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert "reward.params.function" in result.stderr and "math_reward_fn" in result.stderr


def test_the_composite_fragment_scores_the_example_completions(tmp_path: Path) -> None:
    out = tmp_path / "scored.jsonl"
    result = rlfabric(
        "reward", "score", "--input", "examples/math-completions.jsonl", "--output", str(out),
        "--scorer", "examples/reward-composite.toml", "--workers", "1", "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["status"] for r in rows} == {"ok"}
    first = rows[0]  # "\boxed{\frac{3}{4}}" for 3/4: correct and boxed
    assert first["reward"] == pytest.approx(1.1) and first["components"]["correct"] == 1.0
