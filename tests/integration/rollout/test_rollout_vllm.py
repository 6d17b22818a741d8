"""`rlfabric serve rollout` with real vLLM on CPU, as a real process, over real gRPC.

One replica for the module: its logprobs match a transformers forward pass of the weights it serves,
before and after in-place updates through the object store and through a torch.distributed broadcast;
a corrupted version is refused while the old one keeps serving.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rlfabric.contracts import wire
from rlfabric.local.procs import ServiceProcess
from rlfabric.rollout.vllm_engine import cpu_compile_cache_defaults
from rlfabric.rollout.vllm_executor import BLOCKING_MESSAGE
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfabric.weights import versions as store

pytestmark = pytest.mark.vllm
TOKEN = "learner-secret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CLIENT_TOKEN = "client-secret"
CLIENT_AUTH = (("authorization", f"Bearer {CLIENT_TOKEN}"),)


def state_dict_of(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def replica_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rollout-logs") / "rollout.log"


@pytest.fixture(scope="module")
def replica_proc(
    tiny_model_dir: Path, weights_root: Path, vllm_env: dict[str, str], replica_log: Path
) -> Iterator[tuple[ServiceProcess, str]]:
    proc = ServiceProcess(
        "rollout",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "rollout",
            "--model", str(tiny_model_dir), "--port", "0",
            "--set", "engine.enforce_eager=true", "--set", "engine.kv_cache_bytes=268435456",
            "--set", "engine.max_model_len=256", "--set", f"weights_root={weights_root}",
            "--set", "log.format=text", "--set", "max_tokens=64",
        ],
        log_path=replica_log,
        env={
            **vllm_env,
            "RLFABRIC_ROLLOUT__LEARNER_TOKEN": TOKEN,
            "RLFABRIC_ROLLOUT__CLIENT_TOKEN": CLIENT_TOKEN,
        },
    )  # fmt: skip
    address = proc.start(r"listening on (\S+)", timeout_s=300).group(1)
    proc.wait_for(r"serving version", timeout_s=300)
    yield proc, address
    assert proc.stop(grace_s=30) == 0


@pytest.fixture(scope="module")
def replica(replica_proc: tuple[ServiceProcess, str]) -> str:
    return replica_proc[1]


@pytest.fixture
def stub(replica: str) -> Iterator[rollout_pb2_grpc.RolloutServiceStub]:
    with grpc.insecure_channel(replica) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


def generate(stub: rollout_pb2_grpc.RolloutServiceStub, n: int = 2) -> list[rollout_pb2.GeneratedSample]:
    request = rollout_pb2.GenerateRequest(
        request_id=f"r-{torch.randint(1 << 30, ()).item()}",
        prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="hello world"))],
        sampling=rollout_pb2.SamplingParams(n=n, temperature=1.0, max_tokens=12, seed=5),
    )
    return list(stub.Generate(request, timeout=120, metadata=CLIENT_AUTH))


def reference(
    model_dir: Path, sd: dict[str, torch.Tensor], sample: rollout_pb2.GeneratedSample
) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(sd, strict=False)
    prompt, out = list(sample.prompt_token_ids), list(sample.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def assert_matches(
    model_dir: Path, sd: dict[str, torch.Tensor], samples: list[rollout_pb2.GeneratedSample]
) -> None:
    for s in samples:
        got = torch.tensor(list(s.logprobs))
        assert torch.allclose(got, reference(model_dir, sd, s), atol=1e-4), (got, reference(model_dir, sd, s))


def test_idle_replica_does_not_spin(
    replica_proc: tuple[ServiceProcess, str], stub: rollout_pb2_grpc.RolloutServiceStub, replica_log: Path
) -> None:
    """On CPU the replica's default `engine.worker_wait` is block: vLLM runs our executor, which switched
    the engine core's and the worker's queue readers to blocking waits (it logs a warning when it cannot).
    vLLM's own readers spin for a second after every message: a worker left that way burns ~0.7 CPU
    seconds in the window measured here, right after a batch, when an on-policy learner starts."""
    import psutil

    log = replica_log.read_text()
    assert BLOCKING_MESSAGE in log, log[-3000:]
    assert "could not switch" not in log
    tree = psutil.Process(replica_proc[0].pid)

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in [tree, *tree.children(recursive=True)])

    assert generate(stub)
    time.sleep(0.2)
    before = cpu_seconds()
    time.sleep(1.0)
    assert cpu_seconds() - before < 0.3


def test_logprobs_match_transformers(stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path) -> None:
    samples = generate(stub, n=3)
    assert sorted(s.sample_index for s in samples) == [0, 1, 2]
    assert {s.policy_version for s in samples} == {0}
    assert_matches(tiny_model_dir, state_dict_of(tiny_model_dir), samples)


def test_object_store_update_then_corrupted_version_refused(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, weights_root: Path, tmp_path: Path
) -> None:
    new = state_dict_of(make_tiny_model(tmp_path / "v1", seed=11))
    store.publish_version(str(weights_root), 1, new)
    stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=1, object_store=rollout_pb2.ObjectStoreSource()),
        metadata=AUTH,
        timeout=120,
    )
    samples = generate(stub)
    assert {s.policy_version for s in samples} == {1}
    assert_matches(tiny_model_dir, new, samples)

    bad = store.publish_version(
        str(weights_root), 2, state_dict_of(make_tiny_model(tmp_path / "v2", seed=12))
    )
    shard = next(Path(bad.path).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(version=2, object_store=rollout_pb2.ObjectStoreSource()),
            metadata=AUTH,
            timeout=120,
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    samples = generate(stub)
    assert {s.policy_version for s in samples} == {1}
    assert_matches(tiny_model_dir, new, samples)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_broadcast_update(
    stub: rollout_pb2_grpc.RolloutServiceStub, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import threading

    from rlfabric.weights import broadcast

    new = state_dict_of(make_tiny_model(tmp_path / "v3", seed=13))
    port = free_port()
    metas = broadcast.metas_from_state_dict(new)
    source = rollout_pb2.BroadcastSource(
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        backend="gloo",
        tensors=wire.metas_to_proto(metas),
        bucket_bytes=1 << 20,
    )
    sent: dict[str, object] = {}
    sender = threading.Thread(
        target=lambda: sent.update(
            stats=broadcast.send_state_dict(
                new, host="127.0.0.1", port=port, world_size=2, bucket_bytes=1 << 20, timeout_s=120
            )
        )
    )
    sender.start()
    reply = stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=3, broadcast=source, timeout_seconds=120),
        metadata=AUTH,
        timeout=150,
    )
    sender.join(150)
    assert reply.version == 3 and "stats" in sent
    samples = generate(stub)
    assert {s.policy_version for s in samples} == {3}
    assert_matches(tiny_model_dir, new, samples)


def test_on_cpu_the_compile_cache_that_loads_is_chosen_unless_the_caller_chose() -> None:
    """vLLM's AOT-compiled artifacts do not load on CPU (every compiled start compiled again); its older
    cache path does. GPU platforms keep vLLM's default, and an explicit setting always wins."""
    environ: dict[str, str] = {}
    cpu_compile_cache_defaults(environ, cpu=True)
    assert environ == {"VLLM_USE_AOT_COMPILE": "0"}
    chosen = {"VLLM_USE_AOT_COMPILE": "1"}
    cpu_compile_cache_defaults(chosen, cpu=True)
    assert chosen == {"VLLM_USE_AOT_COMPILE": "1"}
    elsewhere: dict[str, str] = {}
    cpu_compile_cache_defaults(elsewhere, cpu=False)
    assert elsewhere == {}
