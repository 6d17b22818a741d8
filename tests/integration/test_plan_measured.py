"""The memory planner against a real learner process: a tiny model trained for two steps by the real
`Trainer` (FSDP2 over gloo) in a fresh process, whose peak RSS must be within 15 % of the prediction.

The micro-batch is long (8 x 1,024 tokens) so that activations are a large share of the peak, not only
the framework's fixed overhead."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from plan import Config, predict  # noqa: E402

GOAL = 0.15


RUNS = 2
"""Fresh child processes measured; the smaller peak is compared (peak RSS varies between runs of the same
training: bench/plan.py saw up to 11 % between repeats, and compares medians). Each child reads its own
VmHWM (`rlfabric.runtime.memory`): with `ru_maxrss`, a child of this test process reported the test
runner's own peak (1.2-1.4 GB after the suite's earlier tests) instead of its ~0.85 GB."""


def peak_rss_of_a_run(config: Config, model_dir: Path) -> int:
    """Peak RSS of one fresh learner process training `config` (`bench/plan.py --child`)."""
    job = {"kind": "train", "config": asdict(config), "model_dir": str(model_dir)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan.py"), "--child", json.dumps(job)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return int(json.loads(line.removeprefix("RESULT "))["peak_rss"])


def test_tiny_learner_peak_is_within_goal_of_the_prediction(tiny_model_dir: Path) -> None:
    config = Config("tiny", "tiny", micro_batch=8, samples=8, prompt=24, completion=1000)
    peaks = [peak_rss_of_a_run(config, tiny_model_dir) for _ in range(RUNS)]
    measured = min(peaks)
    prediction = predict(config, tiny_model_dir, "cpu")
    activations = sum(x["bytes"] for x in prediction["lines"] if x["name"] == "activations")
    assert activations > 0.2 * prediction["total"]  # the check is not the overhead constant alone
    rel = (prediction["total"] - measured) / measured
    runs = ", ".join(f"{p:,}" for p in peaks)
    assert abs(rel) <= GOAL, (
        f"predicted {prediction['total']:,} B, measured {measured:,} B ({rel:+.1%}; runs {runs})"
    )
