"""`python examples/rlhf/run.py --quick`, the RLHF example's one command, with real processes at every
stage: the tiny policy, `rlfabric prefs build` sampling from a replica it starts (the gold preference as
the judge, the planted evaluation prompts decontaminated), a reward model trained through `rlfabric up`
(`mode = "reward_model"`), a GRPO run against it through `rlfabric up` with the gold reward as the
held-out evaluation, DPO on the same version, and the figure.

What must hold: the dataset version verifies and its report names the planted contamination; the reward
model ranks held-out pairs above chance; the RL run's evaluations carry both the proxy and the gold reward
at a measured KL; the proxy rose (the policy learned the reward model); DPO's final model was scored; the
figure was written. How far the gold reward rises is the example's measurement (docs/rlhf.md), not this
test's: a 6-step run is a smoke test of the plumbing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfabric.prefs import store

ROOT = Path(__file__).resolve().parents[2]
# The example's four stages are the fixture of the module's first test: ~7 min on a 2-core CPU computing in
# float32, more beside another test worker. Its limit, not the suite's 600 s.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]) -> Path:
    out = tmp_path_factory.mktemp("rlhf")
    argv = [sys.executable, str(ROOT / "examples" / "rlhf" / "run.py"), "--quick", "--out", str(out)]
    argv += ["--learner-threads", "1"]  # beside another test worker on a small machine
    done = subprocess.run(argv, cwd=ROOT, env=vllm_env, capture_output=True, text=True, timeout=1400)
    (out / "run.out").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def results(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())


def test_the_preference_version_verifies_and_caught_the_planted_contamination(example: Path) -> None:
    version = example / "prefs" / results(example)["version"]
    assert store.verify(version).ok
    dropped = [json.loads(line) for line in (version / "dropped.jsonl").read_text().splitlines()]
    contaminated = {d["row"]["prompt"] for d in dropped if d["rule"] == "contaminated"}
    planted = [
        json.loads(line) for line in (ROOT / "examples/rlhf/label_prompts.jsonl").read_text().splitlines()
    ]
    assert contaminated == {r["prompt"] for r in planted if r["planted"]}


def test_the_reward_model_ranks_held_out_pairs_above_chance(example: Path) -> None:
    rows = [
        json.loads(line) for line in (example / "rm-0" / "rm-0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["eval_accuracy"] >= 0.7  # 0.85-0.89 at the full length; chance is 0.5


def test_the_rl_run_evaluates_proxy_and_gold_against_kl(example: Path) -> None:
    (run,) = results(example)["runs"]
    points = run["points"]
    assert len(points) >= 2 and all({"kl", "proxy", "gold"} <= p.keys() for p in points)
    assert points[-1]["proxy"] > points[0]["proxy"]  # the policy learned what the reward model wants
    assert points[-1]["kl"] > 0


def test_dpo_was_trained_and_scored_and_the_figure_written(example: Path) -> None:
    dpo = results(example)["dpo"]
    assert isinstance(dpo["gold"], float) and isinstance(dpo["initial_gold"], float)
    assert (example / "dpo" / "dpo" / "model" / "config.json").exists()
    assert (example / "overoptimization.png").stat().st_size > 10_000
