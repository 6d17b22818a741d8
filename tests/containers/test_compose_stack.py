"""The compose stack (docker-compose.yml) from images built in CI (scripts/ci_containers.sh builds them
offline and runs this module): Redis, the reward service, two vLLM replicas, the learner and the
coordinator, each in its own container from the light or the CPU image. The `submit` container posts the
demo run to the coordinator's REST API; the test follows the run over that API to the end, checks the
reward rose, and audits the books with the ledger tool in a container on the stack's network.

Needs a Docker daemon and the images named by RLFABRIC_IMAGE, RLFABRIC_LIGHT_IMAGE and
RLFABRIC_REDIS_IMAGE; deselected by default (marker `containers`), run by the CI stage with
`pytest tests/containers -m containers`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

pytestmark = pytest.mark.containers

REPO = Path(__file__).resolve().parents[2]
IMAGES = ("RLFABRIC_IMAGE", "RLFABRIC_LIGHT_IMAGE", "RLFABRIC_REDIS_IMAGE")
API_TOKEN = "dev-api-token-not-secret"  # docker-compose.yml's development default
REDIS_URL = "redis://:dev-redis-password-not-secret@redis:6379/0"
RUN_TIMEOUT_S = 1500.0


def compose_command() -> list[str]:
    """Compose v2 (`docker compose`) when the CLI has it, else v1 (`docker-compose`)."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    return ["docker", "compose"] if v2.returncode == 0 else ["docker-compose"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    command: list[str]
    env: dict[str, str]
    api: str
    run: dict[str, Any]
    final: dict[str, Any] | None = None

    def compose(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.command, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)}: {result.returncode}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
            )
        return result

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", timeout=120, check=False).stdout

    def get(self, path: str) -> dict[str, Any]:
        response = httpx.get(
            f"{self.api}{path}", headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=10
        )
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    missing = [name for name in IMAGES if not os.environ.get(name)]
    assert not missing, f"set {', '.join(missing)} to the images to test (scripts/ci_containers.sh does)"
    port = free_port()
    env = {**os.environ, "COMPOSE_PROJECT_NAME": f"rlfabric-ci-{os.getpid()}", "RLFABRIC_API_PORT": str(port)}
    stack = Stack(
        compose_command(),
        env,
        f"http://127.0.0.1:{port}",
        yaml.safe_load((REPO / "deploy" / "compose" / "run.yaml").read_text()),
    )
    try:
        stack.compose("config", "-q")
        stack.compose("up", "-d")
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)


@pytest.fixture(scope="module")
def finished(stack: Stack) -> dict[str, Any]:
    """The demo run's status once it reached a final state (the submit container posted it)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            status = stack.get("/v1/runs/demo")
        except httpx.HTTPError:
            status = {}  # the coordinator is still starting, or the run is not submitted yet
        if status.get("state") in ("completed", "failed", "stopped"):
            break
        time.sleep(5)
    assert status.get("state") == "completed", f"{status.get('state')}: {status.get('error')}\n{stack.logs()}"
    return status


def test_the_serving_containers_are_healthy(stack: Stack, finished: dict[str, Any]) -> None:
    """The images' health checks pass for the long-running services (the learner restarts once its run is
    done, and `model` and `submit` are one-off containers)."""
    health = {}
    for service in ("redis", "reward", "rollout-0", "rollout-1", "coordinator"):
        (container,) = stack.compose("ps", "-q", service).stdout.split()
        inspect = subprocess.run(
            ["docker", "inspect", "--format", "{{.State.Health.Status}}", container],
            capture_output=True,
            text=True,
            env=stack.env,
            check=True,
        )
        health[service] = inspect.stdout.strip()
    assert set(health.values()) == {"healthy"}, health


def test_the_demo_learns(stack: Stack, finished: dict[str, Any]) -> None:
    steps = stack.run["train"]["steps"]
    rows = [r for r in stack.get("/v1/runs/demo/metrics")["rows"] if "reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last)
    assert finished["evaluation"] is not None  # held-out evaluation ran


def test_the_books_balance(stack: Stack, finished: dict[str, Any]) -> None:
    """The ledger tool, in a container of the CPU image on the stack's network with its state volume."""
    run_dir = f"{stack.run['output_dir']}/demo"
    result = stack.compose(
        "run",
        "--rm",
        "--no-deps",
        "-T",
        "--entrypoint",
        "python",
        "learner",
        "-m",
        "rlfabric.tools.ledger",
        "--redis-url",
        REDIS_URL,
        "--run-id",
        "demo",
        "--checkpoints",
        f"{run_dir}/checkpoints",
        "--weights-root",
        f"{run_dir}/weights",
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    books = json.loads(result.stdout[result.stdout.index("{") :])
    assert books["violations"] == []
    groups = stack.run["train"]["steps"] * stack.run["train"]["groups_per_step"]
    assert books["outcomes"]["trained"] == groups, books["outcomes"]
