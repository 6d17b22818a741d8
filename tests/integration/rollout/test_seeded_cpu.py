"""Seeded sampling on vLLM's CPU engine survives prefills that do not fit one step.

With vLLM's default (chunked prefill on), the batch of `_seeded_batch.py` kills the CPU engine
(`RuntimeError: CPU Generator does not use offset`, then `EngineDeadError` for every request: checked by
hand with `--upstream-chunked-prefill`). `VllmEngine` turns chunked prefill off on CPU; the same batch
must then finish, and the seeds must still mean something: the same request twice gives the same samples.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfabric.rollout.vllm_engine import chunked_prefill

HELPER = Path(__file__).with_name("_seeded_batch.py")


def test_chunked_prefill_is_off_on_cpu_only() -> None:
    assert chunked_prefill(cpu=True) is False
    assert chunked_prefill(cpu=False) is None  # vLLM's own default on accelerators


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("seeded") / "report.json"
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # worker in the engine core: faster start
    command = [sys.executable, str(HELPER), str(tiny_model_dir), f"--out={out}"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "does not use offset" not in proc.stderr
    return json.loads(out.read_text())


def tokens(samples: list[dict[str, Any]]) -> list[list[int]]:
    return [s["token_ids"] for s in samples]


@pytest.mark.vllm
def test_a_seeded_batch_larger_than_a_step_completes(report: dict[str, Any]) -> None:
    assert "error" not in report, report.get("error")
    assert sum(report["prompt_tokens"]) > 2048  # more than vLLM's default step budget: it would chunk
    assert [len(r) for r in report["rounds"]] == [16, 16]
    assert all(s["finish_reason"] == "length" and len(s["token_ids"]) == 8 for s in report["rounds"][0])


@pytest.mark.vllm
def test_seeds_reproduce_samples_across_requests(report: dict[str, Any]) -> None:
    first, second = report["rounds"]
    assert tokens(first) == tokens(second)
    # Log-probs agree up to float32 rounding (the two rounds batch the same rows in another order).
    for a, b in zip(first, second, strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    by_prompt = [tokens(first[i : i + 2]) for i in range(0, 16, 2)]
    assert all(a[0] != b[0] for a, b in by_prompt)  # each sample has its own seed
