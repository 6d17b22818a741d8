"""`rlfabric up --compile` with real vLLM: the run is served by an eager replica from the start, a
compiled twin builds meanwhile and takes over, and nothing is lost on the way.

The run gets far more steps than it needs and is stopped through the REST API a few steps after the
hand-over, so the outcome does not depend on how long the compile takes. The test brings its own
redis-server (`--redis-url`) so it can watch the groups stream while the run goes on: acknowledged
entries are trimmed within seconds, so the replica ids of the scored groups are read as they come. The
compiled twin really compiles (dynamo on, a fresh inductor cache in the test's folder): ~1-2 min on two
cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from rlfabric.contracts import keys
from rlfabric.local.procs import ServiceProcess
from rlfabric.tools import ledger
from rlfabric.v1 import queue_pb2

pytestmark = pytest.mark.vllm
MAX_STEPS = 400
"""A bound the run never reaches: the test stops it."""
STEPS_AFTER = 4
"""Steps trained after the hand-over, before the stop."""
TIMEOUT_S = 900.0


class Watch:
    """Polls `up`'s output and the run's groups stream until a condition holds."""

    def __init__(self, proc: subprocess.Popen[str], out: Path, books: redis.Redis) -> None:
        self.proc, self.out, self.books = proc, out, books
        self.replicas: dict[str, int] = {}

    def sample_stream(self) -> None:
        for _, fields in self.books.xrevrange(keys.groups("demo"), count=16):
            group = queue_pb2.ScoredGroup.FromString(fields[b"data"])
            for sample in group.samples:
                self.replicas[sample.replica_id] = self.replicas.get(sample.replica_id, 0) + 1

    def until(self, what: str, check: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            self.sample_stream()
            if value := check():
                return value
            assert self.proc.poll() is None, f"`up` exited before {what}:\n{self.out.read_text()[-3000:]}"
            time.sleep(0.3)
        raise AssertionError(f"no {what} after {TIMEOUT_S:.0f} s:\n{self.out.read_text()[-3000:]}")


def status(url: str, headers: dict[str, str]) -> dict[str, Any]:
    try:
        return dict(httpx.get(f"{url}/v1/runs/demo", headers=headers, timeout=10).json())
    except httpx.HTTPError:
        return {}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import socket

    data = tmp_path_factory.mktemp("handoff-redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
    argv += ["--appendonly", "yes"]
    proc = ServiceProcess("redis", argv, log_path=data / "redis.log")
    proc.start(r"Ready to accept connections", timeout_s=30)
    yield f"redis://127.0.0.1:{port}/0", redis.Redis(port=port)
    proc.stop()


@pytest.fixture(scope="module")
def handed_over(
    tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str], redis_server: Any
) -> tuple[Path, Watch]:
    run_dir = tmp_path_factory.mktemp("up-handoff")
    redis_url, books = redis_server
    out = run_dir / "up.out"
    argv = [sys.executable, "-m", "rlfabric.cli", "up", "--run-dir", str(run_dir), "--steps", str(MAX_STEPS)]
    argv += ["--no-progress", "--compile", "--redis-url", redis_url]
    env = {k: v for k, v in vllm_env.items() if k != "TORCHDYNAMO_DISABLE"}  # the twin must compile
    env.update(PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor"))
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    watch = Watch(proc, out, books)
    try:
        page = watch.until(
            "the run's page", lambda: re.search(r"page: (http://\S+)/runs/demo", out.read_text())
        )
        url = page.group(1)
        token = json.loads((run_dir / "credentials.json").read_text())["api"]
        headers = {"Authorization": f"Bearer {token}"}

        def step() -> int:
            return int(status(url, headers).get("step") or 0)

        watch.until("a step served eagerly", lambda: step() >= 1)
        watch.until("the hand-over", lambda: "handoff: rollout-0-compiled ready" in out.read_text())
        at = step()
        watch.until(f"step {at + STEPS_AFTER}", lambda: step() >= at + STEPS_AFTER)
        httpx.post(f"{url}/v1/runs/demo/stop", headers=headers, timeout=10).raise_for_status()
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    return run_dir, watch


def test_the_eager_replica_served_first_and_the_compiled_twin_took_over(
    handed_over: tuple[Path, Watch],
) -> None:
    run_dir, watch = handed_over
    output = (run_dir / "up.out").read_text()
    assert "starting rollout-0-compiled (compiled; rollout-0 serves meanwhile)" in output, output[-3000:]
    assert "run demo: stopped at step" in output, output[-3000:]
    assert "supervise: rollout-0 exited" not in output  # the drained eager replica is not restarted
    assert set(watch.replicas) == {"rollout-0", "rollout-0-compiled"}, watch.replicas
    assert any((run_dir / "inductor").rglob("*.py")), "the twin compiled nothing into its inductor cache"
    # the stand-in is the transformers engine, batching prompts (ready in seconds, no vLLM started); the
    # twin, which serves from then on, is vLLM with its own worker process
    stand_in = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "engine: transformers" in stand_in and "vllm" not in stand_in.lower(), stand_in[-2000:]
    assert "VllmWorker" in (run_dir / "logs" / "rollout-0-compiled.log").read_text()


def test_books_balance_across_the_hand_over(handed_over: tuple[Path, Watch], redis_server: Any) -> None:
    run_dir, _ = handed_over
    books = redis_server[1]
    run = run_dir / "demo"
    result = ledger.check(books, "demo", run / "checkpoints", weights_root=str(run / "weights"))
    trained = result.count()[ledger.TRAINED]
    assert books.hget("rlfabric:demo:counters", "groups_trained") == str(trained).encode()
    stopped_at = int(re.search(r"run demo: stopped at step (\d+)", (run_dir / "up.out").read_text())[1])
    assert trained >= stopped_at * 8 > 0
