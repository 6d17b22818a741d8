"""Session-wide test setup: no network for model hubs, and a tiny model built locally once per session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Set at import, before any test imports transformers or huggingface_hub: nothing is ever downloaded.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 model with a character tokenizer (`rlfabric.common.tiny_model` defaults)."""
    from rlfabric.common.tiny_model import make_tiny_model

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
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / f"rlfabric-tests-vllm-cache-{os.getuid()}"),
        "TMPDIR": str(scratch),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
