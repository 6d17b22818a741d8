"""`loadtest/rollout_locustfile.py` against a real replica (`rlfabric serve rollout`, the transformers
engine, a tiny local model), with real locust: every call is streamed to its end and counted, the calls a
replica at capacity refuses (RESOURCE_EXHAUSTED, its `max_in_flight`) are counted as shed and not as
failures, and a call the replica refuses for another reason (a wrong token) is a failure. The figures of a
longer run against a vLLM replica are in loadtest/README.md."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from standalone_replica import start_replica

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "loadtest-client-token"
SUMMARY = re.compile(r"rollout loadtest: (\d+) calls, (\d+) failures, (\d+) shed; (\d+) samples")


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A replica that admits 2 prompts at a time; its address."""
    logs = tmp_path_factory.mktemp("loadtest")
    proc, address = start_replica(tiny_model_dir, logs / "rollout.log", TOKEN, "max_in_flight=2")
    try:
        yield address
    finally:
        proc.stop()


def locust(address: str, token: str, seconds: int) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """A headless locust run of 6 users (3x what the replica admits); its output and summary figures."""
    argv = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "rollout_locustfile.py"), "--headless",
        "-u", "6", "-r", "6", "-t", f"{seconds}s", "-H", address, "--n", "2", "--max-tokens", "8",
        "--token", token, "--only-summary",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT)
    match = SUMMARY.search(done.stdout + done.stderr)
    assert match is not None, done.stdout[-3000:] + done.stderr[-3000:]
    return done, [int(x) for x in match.groups()]


def test_calls_are_streamed_and_counted_and_shedding_is_not_a_failure(replica: str) -> None:
    done, (calls, failures, shed, samples) = locust(replica, TOKEN, seconds=8)
    assert calls > 0 and failures == 0, done.stdout[-3000:]
    assert samples == 2 * calls  # every call streamed its n samples
    assert shed > 0  # 6 users, 2 admitted at a time: the replica sheds, and that is not a failure
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_call_refused_for_another_reason_is_a_failure(replica: str) -> None:
    done, (calls, failures, _, samples) = locust(replica, "not-the-token", seconds=3)
    assert calls > 0 and failures == calls and samples == 0, done.stdout[-3000:]
    assert "UNAUTHENTICATED" in done.stdout + done.stderr
