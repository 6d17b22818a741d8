"""A fleet replica on real vLLM (CPU), as a real `rlfabric serve rollout` process with `fleet` set, real
Redis and real gRPC.

Two runs are members of the fleet (`contracts.fleet.join`), each with adapter versions published in its
own weights root (`weights.adapters.publish_adapter`) and announced in `keys.version(run)`: the replica
loads both (GetInfo and its registry entry under `keys.fleet_scope` list them), loads a newer announced
version of one, and generates on each adapter with the logprobs of transformers + PEFT with that adapter
version. With both of its `engine.max_adapters=2` slots held, a third member waits; when a run leaves the
fleet (`contracts.fleet.leave`) its adapter is unloaded and the waiting member's adapter takes the slot.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch

from rlfabric.contracts import fleet, keys
from rlfabric.contracts.fleet import FleetMember
from rlfabric.contracts.registry import discover
from rlfabric.local.procs import ServiceProcess
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfabric.weights.adapters import publish_adapter, run_adapter_name

pytestmark = pytest.mark.vllm
CLIENT_TOKEN = "client-secret"
CLIENT_AUTH = (("authorization", f"Bearer {CLIENT_TOKEN}"),)
SUFFIX = uuid.uuid4().hex[:8]
FLEET = f"fleet-{SUFFIX}"
RUN_A, RUN_B, RUN_C = (f"run-{x}-{SUFFIX}" for x in "abc")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_model(model_dir: Path, seed: int) -> Any:
    """The tiny model with a random, non-zero rank-8 LoRA adapter on every projection."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(base_model(model_dir), config).eval()


def publish(root: Path, version: int, model: Any) -> None:
    from peft import get_peft_model_state_dict

    config = {
        k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()
    }
    publish_adapter(root, version, get_peft_model_state_dict(model), config)


def member(roots: Path, run: str) -> FleetMember:
    return FleetMember(run, run_adapter_name(run), str(roots / run), 1.0)


def join(client: redis.Redis, redis_url: str, roots: Path, run: str, version: int, model: Any) -> None:
    """Run `run` publishes adapter version `version`, announces it and joins the fleet."""
    publish(roots / run, version, model)
    client.set(keys.version(run), version)
    on_redis(redis_url, lambda r: fleet.join(r, FLEET, member(roots, run)))


def on_redis(url: str, use: Callable[[Any], Awaitable[Any]]) -> Any:
    """`use(an asyncio Redis client)`, run to completion (the contracts' helpers are async)."""
    import redis.asyncio as aioredis

    async def run() -> Any:
        client = aioredis.Redis.from_url(url)
        try:
            return await use(client)
        finally:
            await client.aclose()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`<roots>/<run>`: each run's weights root."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def client(redis_server: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()


@pytest.fixture(scope="module")
def replica(
    tiny_model_dir: Path,
    vllm_env: dict[str, str],
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    proc = ServiceProcess(
        "rollout",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "rollout",
            "--model", str(tiny_model_dir), "--port", "0",
            "--set", "engine.enforce_eager=true", "--set", "engine.kv_cache_bytes=268435456",
            "--set", "engine.max_model_len=256", "--set", "engine.dtype=float32",
            "--set", "engine.max_adapters=2", "--set", "engine.max_adapter_rank=8",
            "--set", f"fleet={FLEET}", "--set", f"redis.url={redis_server}", "--set", "heartbeat_s=30",
            "--set", "log.format=text", "--set", "max_tokens=64", "--set", "replica_id=fleet-0",
        ],
        log_path=tmp_path_factory.mktemp("rollout-logs") / "rollout.log",
        env={
            **vllm_env,
            "RLFABRIC_ROLLOUT__CLIENT_TOKEN": CLIENT_TOKEN,
            "RLFABRIC_ROLLOUT__LEARNER_TOKEN": "learner-secret",
        },
    )  # fmt: skip
    address = proc.start(r"listening on (\S+)", timeout_s=300).group(1)
    proc.wait_for(r"serving version 0", timeout_s=300)
    yield address
    assert proc.stop(grace_s=30) == 0


@pytest.fixture(scope="module")
def stub(replica: str) -> Iterator[rollout_pb2_grpc.RolloutServiceStub]:
    with grpc.insecure_channel(replica) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


def held(stub: rollout_pb2_grpc.RolloutServiceStub) -> dict[str, int]:
    info = stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=CLIENT_AUTH, timeout=30)
    return {a.name: a.version for a in info.adapters}


def registered(redis_url: str) -> dict[str, int]:
    (entry,) = on_redis(redis_url, lambda r: discover(r, keys.fleet_scope(FLEET)))
    return entry.adapter_versions()


def eventually(read: Callable[[], Any], expected: Any, timeout_s: float = 60.0) -> None:
    """Polls `read()` until it returns `expected` (the replica follows its fleet every poll)."""
    deadline = time.monotonic() + timeout_s
    got = read()
    while got != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        got = read()
    assert got == expected


def generate(
    stub: rollout_pb2_grpc.RolloutServiceStub, adapter: str, min_version: int = 0
) -> list[rollout_pb2.GeneratedSample]:
    request = rollout_pb2.GenerateRequest(
        request_id=f"r-{time.monotonic_ns()}",
        prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="hello world"))],
        sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5),
        adapter=adapter,
        min_policy_version=min_version,
    )
    return list(stub.Generate(request, timeout=120, metadata=CLIENT_AUTH))


def reference(model: Any, sample: rollout_pb2.GeneratedSample) -> torch.Tensor:
    """log p(token_ids[i] | prompt + token_ids[:i]) under `model`, one forward pass."""
    prompt, out = list(sample.prompt_token_ids), list(sample.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def assert_matches(model: Any, samples: list[rollout_pb2.GeneratedSample], version: int) -> None:
    assert samples and {s.policy_version for s in samples} == {version}
    for s in samples:
        got = torch.tensor(list(s.logprobs))
        assert torch.allclose(got, reference(model, s), atol=1e-4), (got, reference(model, s))


def test_the_members_adapters_are_loaded_followed_and_served(
    stub: rollout_pb2_grpc.RolloutServiceStub, client: redis.Redis, redis_server: str, tiny_model_dir: Path,
    roots: Path,
) -> None:  # fmt: skip
    a1, b1 = peft_model(tiny_model_dir, seed=1), peft_model(tiny_model_dir, seed=2)
    join(client, redis_server, roots, RUN_A, 1, a1)
    join(client, redis_server, roots, RUN_B, 1, b1)
    eventually(lambda: held(stub), {RUN_A: 1, RUN_B: 1})
    eventually(lambda: registered(redis_server), {RUN_A: 1, RUN_B: 1}, timeout_s=5)  # beat at the change

    a2 = peft_model(tiny_model_dir, seed=3)
    publish(roots / RUN_A, 2, a2)
    client.set(keys.version(RUN_A), 2)
    assert_matches(a2, generate(stub, RUN_A, min_version=2), 2)  # waits for the replica to load it
    assert_matches(b1, generate(stub, RUN_B), 1)
    assert held(stub) == {RUN_A: 2, RUN_B: 1}


def test_a_run_that_leaves_frees_its_slot_for_a_waiting_member(
    stub: rollout_pb2_grpc.RolloutServiceStub, client: redis.Redis, redis_server: str, tiny_model_dir: Path,
    roots: Path,
) -> None:  # fmt: skip
    c1 = peft_model(tiny_model_dir, seed=4)
    join(client, redis_server, roots, RUN_C, 1, c1)  # both slots held: run C waits
    time.sleep(1.0)
    assert held(stub) == {RUN_A: 2, RUN_B: 1}

    on_redis(redis_server, lambda r: fleet.leave(r, FLEET, RUN_B))
    eventually(lambda: held(stub), {RUN_A: 2, RUN_C: 1})
    eventually(lambda: registered(redis_server), {RUN_A: 2, RUN_C: 1}, timeout_s=5)
    assert_matches(c1, generate(stub, RUN_C), 1)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, RUN_B)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
