"""Bad input and security checks not covered elsewhere: nothing in src/rlfabric/ can deserialise pickle (an
AST scan, proven able to fail), a weight file that is a pickle is refused without being unpickled, a
pickle in the queue is dead-lettered without being unpickled, and the coordinator as a real process
answers 401/422/413 and keeps serving.

Covered by existing tests (referenced in docs/reliability.md, not repeated here): REST 401/422/413
in-process (tests/integration/coordinator/test_api.py), gRPC messages over the limit and bearer tokens
(tests/integration/test_grpc_server.py), mTLS refusing a client without a certificate, with certificates
generated in the test (same file), UpdateWeights without the learner's token
(tests/integration/rollout/test_rollout_service.py), the code sandbox against egress, fork and memory
bombs, infinite loops, writes outside its folder and secret reading
(tests/integration/reward/test_sandbox.py, and through the service in test_reward_service.py).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfabric.contracts import keys
from rlfabric.local.procs import ServiceProcess

SERVICES = Path(__file__).resolve().parents[2] / "src" / "rlfabric"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}


def unsafe_deserialisation(source: str, filename: str = "<src>") -> list[str]:
    """Where `source` imports a pickle-family module, calls torch.load without weights_only=True,
    np.load with allow_pickle=True, or yaml.load / yaml.unsafe_load."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [
                f"{filename}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in BANNED_MODULES
            ]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            call = f"{owner}.{node.func.attr}"
            if call == "torch.load" and keywords.get("weights_only") != "True":
                found.append(f"{filename}:{node.lineno} torch.load without weights_only=True")
            if (
                node.func.attr == "load"
                and owner in ("np", "numpy")
                and keywords.get("allow_pickle") == "True"
            ):
                found.append(f"{filename}:{node.lineno} numpy load with allow_pickle=True")
            if call in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                found.append(f"{filename}:{node.lineno} {call}")
    return found


def test_the_scan_catches_each_pattern() -> None:
    planted = (
        "import pickle\nfrom dill import loads\nimport torch\nimport numpy as np\nimport yaml\n"
        "torch.load('w.pt')\ntorch.load('w.pt', weights_only=False)\nnp.load('a', allow_pickle=True)\n"
        "yaml.load(s)\ntorch.load('ok.pt', weights_only=True)\n"
    )
    flagged = [int(f.split(":")[1].split()[0]) for f in unsafe_deserialisation(planted)]
    assert flagged == [1, 2, 6, 7, 8, 9]  # everything but the weights_only=True load on line 10


def test_nothing_in_services_deserialises_pickle() -> None:
    files = [p for p in SERVICES.rglob("*.py") if "v1" not in p.relative_to(SERVICES).parts]
    assert len(files) > 50
    found = [f for p in files for f in unsafe_deserialisation(p.read_text(), str(p.relative_to(SERVICES)))]
    assert found == []


class Tripwire:
    """Unpickling this writes a file: proof that something unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.path, "unpickled"))


def test_a_weight_file_that_is_a_pickle_is_refused_unopened(tmp_path: Path) -> None:
    import torch

    from rlfabric.weights import versions as store

    root = str(tmp_path / "weights")
    store.publish_version(root, 1, {"w": torch.zeros(2, 2)})
    folder = tmp_path / "weights" / "v000001"
    shard = next(p for p in folder.iterdir() if p.suffix == ".safetensors")
    sentinel = tmp_path / "tripped"
    payload = pickle.dumps({"w": Tripwire(sentinel)})
    shard.write_bytes(payload)
    rewrite_manifest(folder, shard.name, payload)  # a manifest and marker that vouch for the pickle
    with pytest.raises(store.WeightsCorrupted, match="not a valid safetensors file"):
        store.load_version(root, 1)
    assert not sentinel.exists()


def rewrite_manifest(folder: Path, name: str, data: bytes) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())

    def patch(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("name") == name and "sha256" in node:
                node.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            for value in node.values():
                patch(value)
        elif isinstance(node, list):
            for value in node:
                patch(value)

    patch(manifest)
    raw = json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(raw)
    (folder / "COMMITTED").write_text(hashlib.sha256(raw).hexdigest() + "\n")


async def test_a_pickle_in_the_queue_is_dead_lettered_unopened(redis_url: str, tmp_path: Path) -> None:
    import redis.asyncio as aioredis

    from rlfabric.learner.queue import REASON_DECODE, GroupConsumer

    client = aioredis.Redis.from_url(redis_url)
    sentinel = tmp_path / "tripped"
    await client.xadd(keys.groups("sec"), {b"data": pickle.dumps(Tripwire(sentinel))})
    consumer = GroupConsumer(client, "sec", "c")
    assert await consumer.read(10, block_ms=100) == []
    assert consumer.counters.dead_lettered == {REASON_DECODE: 1}
    assert not sentinel.exists()
    await client.aclose()


@pytest.fixture
def coordinator(redis_url: str, tmp_path: Path) -> Any:
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "coordinator", "--port", "0"]
    argv += ["--set", f"redis.url={redis_url}", "--set", "api.max_body_bytes=4096"]
    env = {
        **os.environ,
        "RLFABRIC_COORDINATOR__API__TOKEN": "s3cret",
        "RLFABRIC_COORDINATOR__REWARD_TOKEN": "r",
        "RLFABRIC_COORDINATOR__ROLLOUT_TOKEN": "g",
    }
    proc = ServiceProcess("coordinator", argv, log_path=tmp_path / "coordinator.log", env=env)
    url = proc.start(r"listening on (http://\S+)", timeout_s=60).group(1)
    yield url
    assert proc.running()  # survived everything the test sent
    proc.stop()


def test_the_coordinator_process_refuses_bad_requests_and_keeps_serving(coordinator: str) -> None:
    runs = f"{coordinator}/v1/runs"
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.get(runs, timeout=10).status_code == 401
    assert httpx.get(runs, headers={"Authorization": "Bearer s3cre7"}, timeout=10).status_code == 401
    assert httpx.post(runs, content=b"{nope", headers=good, timeout=10).status_code == 422
    assert httpx.post(runs, json={"name": "x"}, headers=good, timeout=10).status_code == 422
    assert httpx.post(runs, content=b"x" * 10_000, headers=good, timeout=10).status_code == 413
    assert httpx.get(runs, headers=good, timeout=10).status_code == 200
