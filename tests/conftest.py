"""Session-wide test setup: no network for model hubs, and a tiny model built locally once per session."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Set at import, before any test imports transformers or huggingface_hub: nothing is ever downloaded.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
# `dtype = "auto"` is float32 in every process the tests start, on every kind of machine: the numeric
# checks (engine log-probs against a transformers forward, gradients) are written for float32, and an AMX
# CPU would otherwise pick bfloat16. The detection itself is tested in tests/unit/test_hardware.py.
os.environ["RLFABRIC_AUTO_DTYPE"] = "float32"
# Every gRPC service serves /metrics on a fixed default port (`runtime.schema.METRICS_PORTS`); the tests
# start many services on this machine at once, so each process they start picks a free one instead (a
# test that passes its own `server.metrics_port` overrides this).
for _service in ("rollout", "reward", "learner", "environment"):
    os.environ.setdefault(f"RLFABRIC_{_service.upper()}__SERVER__METRICS_PORT", "0")
# The environment every test module starts from (see `_one_environment_per_module`).
SESSION_ENV = dict(os.environ)


@pytest.fixture(scope="module", autouse=True)
def _one_environment_per_module() -> Iterator[None]:
    """Each module starts from `SESSION_ENV` and what it leaves in os.environ ends with it. Importing some
    packages changes the environment of the whole process: TRL's vLLM support sets VLLM_LOGGING_LEVEL=ERROR
    and TORCHINDUCTOR_COMPILE_THREADS=1, so every vLLM a later test started from the same pytest process
    (a worker of `scripts/test.sh` runs many modules) logged nothing and compiled on one thread."""
    _reset_environment()
    yield
    _reset_environment()


def _reset_environment() -> None:
    """os.environ back to `SESSION_ENV`, but for pytest's own variables (PYTEST_CURRENT_TEST, which it
    deletes after each test, and xdist's)."""
    pytest_own = {name: value for name, value in os.environ.items() if name.startswith("PYTEST_")}
    os.environ.clear()
    os.environ.update(SESSION_ENV)
    os.environ.update(pytest_own)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 model with a character tokenizer (`rlfabric.tools.tiny_model` defaults)."""
    from rlfabric.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for a subprocess that starts vLLM on CPU: fastest start-up (eager, no dynamo), loopback
    only, temporary files in a scratch folder, OpenMP threads unbound so that several engines and the test
    process can share the cores.

    The vLLM cache (a few KB of model-class metadata) lives in one temporary folder shared across sessions:
    a fresh one costs ~14 s per engine start, spent inspecting the model class in a subprocess."""
    scratch = tmp_path_factory.mktemp("vllm")
    return {
        **SESSION_ENV,
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / f"rlfabric-tests-vllm-cache-{os.getuid()}"),
        "TMPDIR": str(scratch),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for servers that cannot bind port 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on loopback, as production runs it (AOF on, noeviction); yields its URL.

    Session-scoped: tests isolate themselves by key prefix (use a fresh run id) or with `redis_url`."""
    from rlfabric.local.procs import ServiceProcess

    data = tmp_path_factory.mktemp("redis")
    port = free_port()
    proc = ServiceProcess(
        "redis",
        [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
            "--appendonly", "yes", "--maxmemory-policy", "noeviction", "--save", "",
        ],
        log_path=data / "redis.log",
    )  # fmt: skip
    proc.start(r"Ready to accept connections", timeout_s=30)
    yield f"redis://127.0.0.1:{port}/0"
    proc.stop()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session's Redis, flushed after the test."""
    import redis

    yield redis_server
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
