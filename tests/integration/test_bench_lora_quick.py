"""`bench/lora.py --quick`, as CI runs it: a real vLLM replica with one adapter slot takes a LoRA policy's
versions both as merged full weights and as the adapter alone; checked through the bench's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("full", "adapter")


@pytest.mark.vllm
def test_lora_bench_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lora.py"), "--quick", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "lora.md").read_text().startswith("## lora")
    result = json.loads((tmp_path / "lora.json").read_text())

    assert result["quick"] is True and result["repeats"] == 1
    (case,) = result["sizes"]
    assert case["size"] == "tiny" and case["adapter_parameters"] > 0
    # the merged version is the full model; the adapter only its LoRA tensors (2 per adapted projection)
    assert case["bytes"]["full"] > case["bytes"]["adapter"] > 0
    assert case["tensors"]["adapter"] == 2 * 7 * case["spec"]["layers"]
    for path in PATHS:
        seconds = case["seconds"][path]
        parts = seconds["gather_s"]["median"] + seconds["publish_s"]["median"] + seconds["load_s"]["median"]
        assert seconds["total_s"]["median"] == pytest.approx(parts)
        assert seconds["load_s"]["median"] >= seconds["replica_load_s"]["median"] > 0
        (tokens,) = case["probe_tokens"][path]  # the greedy probe after the load served the new version
        assert 0 < tokens <= result["setup"]["probe_tokens"]
    assert result["sync_time_ratio"] == case["sync_time_ratio"] > 0
    assert result["bytes_ratio"] == pytest.approx(case["bytes"]["full"] / case["bytes"]["adapter"])
    assert isinstance(result["goal_met"], bool)
    assert result["fleet_ratio"] is None and "not measured" in result["fleet_note"]
