"""vLLM on CPU with `worker_wait="block"` (the default there) never stalls a step on a lost wake-up.

The probe (`_stall_probe.py`) streams ~4,700 engine steps of the tiny model, token by token, with short
idle pauses between batches. With vLLM's own blocking wait a dropped queue notification left a reader in
`poll` for 5 s (`Poller timed out` in vLLM's debug log): measured here before the fix, 7 such stalls in
7,908 steps, the longest step gap 5.02 s. A step of the tiny model takes milliseconds, so a gap of 2 s
(generous for two cores shared with other processes) can only be such a stall.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfabric.rollout.vllm_executor import BLOCKING_MESSAGE, RECHECK_MAX_MS, RECHECK_MIN_MS, recheck_ms

PROBE = Path(__file__).with_name("_stall_probe.py")
MAX_STEP_GAP_S = 2.0


def test_recheck_grows_with_the_wait_and_is_bounded() -> None:
    assert recheck_ms(0.0) == RECHECK_MIN_MS
    assert recheck_ms(0.1) == 50
    assert recheck_ms(3600.0) == RECHECK_MAX_MS


@pytest.mark.vllm
def test_blocking_waits_do_not_stall_generation(
    tiny_model_dir: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    env = {**vllm_env, "VLLM_LOGGING_LEVEL": "DEBUG"}
    command = [sys.executable, str(PROBE), str(tiny_model_dir), f"--out={out}", "--rounds=12"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert BLOCKING_MESSAGE in log, log[-4000:]
    report = json.loads(out.read_text())
    assert report["steps"] >= 4000, report
    assert report["max_gap_s"] < MAX_STEP_GAP_S, report
    assert "Poller timed out" not in log
