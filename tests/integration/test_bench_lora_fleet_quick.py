"""`bench/lora_fleet.py --quick --placement split --staleness 0`: two on-policy demo LoRA runs alone and
then on one fleet replica, the real `rlfabric up` each time, the replica's threads on core 0 and the
learners confined to core 1 (`--learner-cores`) and taking turns to train there; checked through the bench's
JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the split placement needs cores 0 and 1")
def test_lora_fleet_bench_quick_split_on_policy(tmp_path: Path) -> None:
    argv = ["--quick", "--placement", "split", "--staleness", "0", "--output-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lora_fleet.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (tmp_path / "lora_fleet.json").exists()  # a configuration's own name, not the default's
    result = json.loads((tmp_path / "lora_fleet_split_s0.json").read_text())
    assert "on-policy" in (tmp_path / "lora_fleet_split_s0.md").read_text()
    assert (result["quick"], result["placement"], result["staleness"], result["runs"]) == (
        True,
        "split",
        0,
        2,
    )
    for side in ("sequential", "fleet"):
        runs = result["result"][side]["runs"]
        assert sorted(runs) == ["demo-1", "demo-2"] and all(r["steps"] == 4 for r in runs.values())
        assert result["result"][side]["samples"] == 2 * 3 * 8 * 8  # samples after each run's first step
        # learners on core 1 take turns to train: every step waited for its turn (0 when none was taken)
        assert all(r["core_wait_s"] is not None and r["core_wait_s"] >= 0 for r in runs.values())
    assert result["fleet_ratio"] > 0 and isinstance(result["goal_met"], bool)
