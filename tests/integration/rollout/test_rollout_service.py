"""The rollout service over real gRPC, with the transformers reference engine (fast, no vLLM).

The same servicer, replica and weight sources run with vLLM in test_rollout_vllm.py; here every rule of
the contract is checked quickly: lifecycle, streaming, versions, bad input, updates (good, corrupted,
stale, unauthenticated), the clients' token on every other RPC, cancellation and the Redis registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from rlfabric.contracts import keys, wire
from rlfabric.rollout.config import RolloutServiceConfig
from rlfabric.rollout.main import Parts, assemble, load_initial_weights, start_server
from rlfabric.runtime.config import load_config
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfabric.weights import versions as store

TOKEN = "learner-secret"
CLIENT_TOKEN = "client-secret"
CLIENT_AUTH = (("authorization", f"Bearer {CLIENT_TOKEN}"),)


def config_for(model: Path, root: Path, *extra: str) -> RolloutServiceConfig:
    return load_config(
        RolloutServiceConfig,
        overrides=[
            f"engine.model={model}", "engine.kind=transformers", "engine.max_model_len=128",
            "server.port=0", f"weights_root={root}", f"learner_token={TOKEN}",
            f"client_token={CLIENT_TOKEN}",            "max_n=8", "max_tokens=32", "max_in_flight=16", *extra,
        ],
    )  # fmt: skip


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as the tiny model, other random weights: what a training step might produce."""
    return make_tiny_model(tmp_path_factory.mktemp("other-model"), seed=7)


def state_dict_of(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


async def started(config: RolloutServiceConfig) -> Parts:
    parts = assemble(config)
    await start_server(parts)
    return parts


async def shutdown(parts: Parts) -> None:
    await parts.server.stop(0)
    await parts.engine.close()
    parts.weights.close()


@pytest.fixture
async def replica(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Parts]:
    parts = await started(config_for(tiny_model_dir, tmp_path / "weights"))
    await load_initial_weights(parts)
    yield parts
    await shutdown(parts)


def stub(parts: Parts) -> rollout_pb2_grpc.RolloutServiceStub:
    return rollout_pb2_grpc.RolloutServiceStub(grpc.aio.insecure_channel(parts.address))


def request(
    n: int = 2, max_tokens: int = 8, request_id: str = "r1", **sampling: float | bool
) -> rollout_pb2.GenerateRequest:
    prompts = [
        rollout_pb2.GeneratePrompt(prompt_id="p0", prompt=common_pb2.Prompt(text="hello")),
        rollout_pb2.GeneratePrompt(
            prompt_id="p1",
            prompt=common_pb2.Prompt(
                messages=common_pb2.ChatMessages(
                    messages=[common_pb2.ChatMessage(role="user", content="2+2?")]
                )
            ),
        ),
    ]
    params = rollout_pb2.SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=3, **sampling)
    return rollout_pb2.GenerateRequest(request_id=request_id, prompts=prompts, sampling=params)


async def collect(parts: Parts, req: rollout_pb2.GenerateRequest) -> list[rollout_pb2.GeneratedSample]:
    return [s async for s in stub(parts).Generate(req, timeout=60, metadata=CLIENT_AUTH)]


def reference_logprobs(
    state_dict: dict[str, torch.Tensor], model_dir: Path, prompt: list[int], out: list[int]
):
    """log p(out[i] | prompt + out[:i]) under `state_dict`, by one plain transformers forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=False)
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


async def test_not_serving_until_weights_are_loaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    parts = await started(config_for(tiny_model_dir, tmp_path / "weights"))
    try:
        async with grpc.aio.insecure_channel(parts.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="rlfabric.v1.RolloutService"))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(parts, request())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            await load_initial_weights(parts)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="rlfabric.v1.RolloutService"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await shutdown(parts)


async def test_generate_streams_n_samples_per_prompt_with_logprobs(
    replica: Parts, tiny_model_dir: Path
) -> None:
    samples = await collect(replica, request(n=3))
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [
        (p, i) for p in (0, 1) for i in range(3)
    ]
    sd = state_dict_of(tiny_model_dir)
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) > 0
        assert s.policy_version == 0 and s.replica_id == replica.replica_id
        assert s.prompt_id == ("p0", "p1")[s.prompt_index]
        expected = reference_logprobs(sd, tiny_model_dir, list(s.prompt_token_ids), list(s.token_ids))
        assert torch.allclose(torch.tensor(list(s.logprobs)), expected, atol=1e-4)


async def test_ignore_eos_generates_every_completion_to_max_tokens(replica: Parts) -> None:
    samples = await collect(replica, request(n=4, max_tokens=24, ignore_eos=True))
    assert len(samples) == 8
    assert {len(s.token_ids) for s in samples} == {24}
    assert {s.finish_reason for s in samples} == {common_pb2.FINISH_REASON_LENGTH}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"n": 9}, "sampling.n"),
        ({"max_tokens": 33}, "sampling.max_tokens"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
    ],
)
async def test_bad_sampling_is_invalid_argument(
    replica: Parts, change: dict[str, float], fragment: str
) -> None:
    req = request()
    for key, value in change.items():
        setattr(req.sampling, key, value)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(replica, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (info.value.details() or "")


async def test_bad_prompts_are_invalid_argument(replica: Parts) -> None:
    cases = [
        (
            rollout_pb2.GenerateRequest(request_id="e", sampling=rollout_pb2.SamplingParams(max_tokens=4)),
            "prompts",
        ),
        (
            rollout_pb2.GenerateRequest(
                request_id="long",
                prompts=[rollout_pb2.GeneratePrompt(prompt=common_pb2.Prompt(text="x" * 200))],
                sampling=rollout_pb2.SamplingParams(max_tokens=4),
            ),
            "exceed the context",
        ),
        (
            rollout_pb2.GenerateRequest(
                request_id="ids",
                prompts=[
                    rollout_pb2.GeneratePrompt(
                        prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[99999]))
                    )
                ],
                sampling=rollout_pb2.SamplingParams(max_tokens=4),
            ),
            "outside the vocabulary",
        ),
    ]
    for req, fragment in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(replica, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req.request_id
        assert fragment in (info.value.details() or "")
    assert len(await collect(replica, request())) == 4  # still serving


def update(version: int, **kw: object) -> rollout_pb2.UpdateWeightsRequest:
    return rollout_pb2.UpdateWeightsRequest(
        version=version, object_store=rollout_pb2.ObjectStoreSource(), **kw
    )


AUTH = (("authorization", f"Bearer {TOKEN}"),)


async def test_object_store_update_switches_weights_and_version(
    replica: Parts, tmp_path: Path, other_model: Path, tiny_model_dir: Path
) -> None:
    new = state_dict_of(other_model)
    store.publish_version(str(tmp_path / "weights"), 1, new)
    reply = await stub(replica).UpdateWeights(update(1), metadata=AUTH, timeout=60)
    assert reply.version == 1 and reply.load_seconds > 0
    samples = await collect(replica, request(n=1))
    assert {s.policy_version for s in samples} == {1}
    s = samples[0]
    expected = reference_logprobs(new, tiny_model_dir, list(s.prompt_token_ids), list(s.token_ids))
    assert torch.allclose(torch.tensor(list(s.logprobs)), expected, atol=1e-4)
    again = await stub(replica).UpdateWeights(update(1), metadata=AUTH, timeout=60)
    assert again.version == 1  # the same version again is a no-op


async def test_corrupted_version_is_refused_and_old_weights_keep_serving(
    replica: Parts, tmp_path: Path, other_model: Path
) -> None:
    before = await collect(replica, request(n=1))
    published = store.publish_version(str(tmp_path / "weights"), 1, state_dict_of(other_model))
    shard = next(Path(published.path).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub(replica).UpdateWeights(update(1), metadata=AUTH, timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert shard.name in (info.value.details() or "")
    after = await collect(replica, request(n=1))
    assert [list(s.logprobs) for s in after] == [list(s.logprobs) for s in before]
    assert {s.policy_version for s in after} == {0}


async def test_mismatched_tensors_are_refused(replica: Parts, tmp_path: Path) -> None:
    wrong = make_tiny_model(tmp_path / "wide", hidden=256, heads=4)
    store.publish_version(str(tmp_path / "weights"), 1, state_dict_of(wrong))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub(replica).UpdateWeights(update(1), metadata=AUTH, timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert {s.policy_version for s in await collect(replica, request(n=1))} == {0}


async def test_stale_and_unauthenticated_updates_are_refused(
    replica: Parts, tmp_path: Path, other_model: Path
) -> None:
    """The attack of issue 17: an unauthenticated update to a far-future version (which would make the
    learner's next real update look older) is refused, and the replica's version does not move."""
    store.publish_version(str(tmp_path / "weights"), 2, state_dict_of(other_model))
    wrong = [(), (("authorization", "Bearer nope"),), (("authorization", TOKEN),), CLIENT_AUTH]
    for metadata in wrong:  # the clients' token is not the learner's
        for version in (2, 999_999):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub(replica).UpdateWeights(update(version), metadata=metadata, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = await stub(replica).GetInfo(rollout_pb2.GetInfoRequest(), metadata=CLIENT_AUTH)
    assert info.policy_version == 0
    assert {s.policy_version for s in await collect(replica, request(n=1))} == {0}
    await stub(replica).UpdateWeights(update(2), metadata=AUTH, timeout=60)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub(replica).UpdateWeights(update(1), metadata=AUTH, timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = await stub(replica).GetInfo(rollout_pb2.GetInfoRequest(), metadata=CLIENT_AUTH)
    assert info.policy_version == 2


LEARNER_RPCS = {"UpdateWeights", "UnloadAdapter"}
"""The RPCs that take the learner's token."""
CLIENT_RPCS = [
    m for m in rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods if m.name not in LEARNER_RPCS
]
"""Every other RPC of the service: each requires the clients' token."""


async def call_empty(channel: grpc.aio.Channel, method: Any, metadata: tuple[tuple[str, str], ...]) -> None:
    """Calls `method` (a method descriptor) with an empty request and reads the whole answer."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    call = kind(
        path,
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )
    answer = call(request_type(), metadata=metadata, timeout=30)
    if method.server_streaming:
        _ = [item async for item in answer]
    else:
        await answer


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer nope"),), (("authorization", CLIENT_TOKEN),), AUTH],
    ids=["none", "wrong", "not-bearer", "learner-token"],
)
async def test_every_rpc_but_update_weights_requires_the_client_token(
    replica: Parts, metadata: tuple[tuple[str, str], ...]
) -> None:
    """Checked before the request is read: an empty Generate would otherwise be INVALID_ARGUMENT."""
    assert {m.name for m in CLIENT_RPCS} >= {"Generate", "GetInfo"}
    async with grpc.aio.insecure_channel(replica.address) as channel:
        for method in CLIENT_RPCS:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call_empty(channel, method, metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method.name
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="rlfabric.v1.RolloutService"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # health stays open


async def test_the_client_token_serves_generate_and_get_info(replica: Parts) -> None:
    async with grpc.aio.insecure_channel(replica.address) as channel:
        client = rollout_pb2_grpc.RolloutServiceStub(channel)
        info = await client.GetInfo(rollout_pb2.GetInfoRequest(), metadata=CLIENT_AUTH, timeout=30)
        samples = [s async for s in client.Generate(request(n=2), metadata=CLIENT_AUTH, timeout=60)]
    assert info.serving and info.policy_version == 0
    assert len(samples) == 4 and all(s.token_ids for s in samples)


async def test_replica_starts_on_the_latest_committed_version(
    tiny_model_dir: Path, tmp_path: Path, other_model: Path
) -> None:
    root = tmp_path / "weights"
    store.publish_version(str(root), 4, state_dict_of(other_model))
    parts = await started(config_for(tiny_model_dir, root))
    try:
        await load_initial_weights(parts)
        assert {s.policy_version for s in await collect(parts, request(n=1))} == {4}
    finally:
        await shutdown(parts)


async def test_cancelled_generate_aborts_engine_work(replica: Parts) -> None:
    call = stub(replica).Generate(
        request(n=8, max_tokens=32, request_id="cancel-me", ignore_eos=True), metadata=CLIENT_AUTH
    )
    first = await call.read()
    assert first is not grpc.aio.EOF
    call.cancel()
    for _ in range(100):
        if replica.replica.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert replica.replica.in_flight == 0
    assert replica.engine.stats().running == 0
    assert len(await collect(replica, request(n=1, request_id="after"))) == 2


async def test_registry_entry_appears_refreshes_and_expires(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    import redis.asyncio as aioredis

    from rlfabric.contracts import registry
    from rlfabric.rollout.main import start_heartbeat

    config = config_for(
        tiny_model_dir, tmp_path / "w", f"redis.url={redis_url}", "run_id=run-r", "heartbeat_s=0.2"
    )
    parts = await started(config)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await load_initial_weights(parts)
        await start_heartbeat(parts)
        [entry] = await registry.discover(client, "run-r")
        assert (entry.address, entry.serving, entry.version) == (parts.address, True, 0)
        beats = parts.heartbeat.beats  # type: ignore[union-attr]
        await asyncio.sleep(0.5)
        assert parts.heartbeat.beats > beats  # type: ignore[union-attr]
        ttl = await client.pttl(keys.replica("run-r", entry.replica_id))
        assert 0 < ttl <= 600
        await parts.heartbeat.stop(deregister_entry=False)  # type: ignore[union-attr]
        await asyncio.sleep(0.8)  # three missed beats
        assert await registry.discover(client, "run-r") == []
    finally:
        await client.aclose()
        await shutdown(parts)


def broadcast_request(version: int, metas: list, port: int) -> rollout_pb2.UpdateWeightsRequest:

    source = rollout_pb2.BroadcastSource(
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        backend="gloo",
        tensors=wire.metas_to_proto(metas),
        bucket_bytes=1 << 20,
    )
    return rollout_pb2.UpdateWeightsRequest(version=version, broadcast=source, timeout_seconds=60)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def send_in_thread(state_dict: dict[str, torch.Tensor], port: int) -> asyncio.Future:
    from rlfabric.weights import broadcast

    return asyncio.get_running_loop().run_in_executor(
        None,
        lambda: broadcast.send_state_dict(
            state_dict, host="127.0.0.1", port=port, world_size=2, bucket_bytes=1 << 20, timeout_s=60
        ),
    )


async def test_broadcast_update_switches_weights(
    replica: Parts, other_model: Path, tiny_model_dir: Path
) -> None:
    from rlfabric.weights import broadcast

    new = state_dict_of(other_model)
    port = free_port()
    sent = await send_in_thread(new, port)
    reply = await stub(replica).UpdateWeights(
        broadcast_request(5, broadcast.metas_from_state_dict(new), port), metadata=AUTH, timeout=90
    )
    await sent
    assert reply.version == 5
    [s, *_] = await collect(replica, request(n=1))
    assert s.policy_version == 5
    expected = reference_logprobs(new, tiny_model_dir, list(s.prompt_token_ids), list(s.token_ids))
    assert torch.allclose(torch.tensor(list(s.logprobs)), expected, atol=1e-4)


async def test_mismatched_broadcast_is_refused_and_the_sender_fails_fast(
    replica: Parts, tmp_path: Path
) -> None:
    from rlfabric.weights import broadcast

    wrong = state_dict_of(make_tiny_model(tmp_path / "wide", hidden=256, heads=4))
    port = free_port()
    sent = await send_in_thread(wrong, port)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub(replica).UpdateWeights(
            broadcast_request(6, broadcast.metas_from_state_dict(wrong), port), metadata=AUTH, timeout=90
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(broadcast.BroadcastError):
        await asyncio.wait_for(sent, 30)
    assert {s.policy_version for s in await collect(replica, request(n=1))} == {0}


async def test_replica_follows_the_announced_version(
    tiny_model_dir: Path, tmp_path: Path, other_model: Path, redis_url: str
) -> None:
    import redis.asyncio as aioredis

    from rlfabric.rollout.main import follow_versions, start_heartbeat

    root = tmp_path / "w"
    config = config_for(tiny_model_dir, root, f"redis.url={redis_url}", "run_id=run-f", "version_poll_s=0.1")
    parts = await started(config)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await load_initial_weights(parts)
        await start_heartbeat(parts)
        follower = asyncio.get_running_loop().create_task(follow_versions(parts))
        store.publish_version(str(root), 1, state_dict_of(other_model))
        await client.set("rlfabric:run-f:version", 1)
        for _ in range(100):
            if parts.replica.version == 1:
                break
            await asyncio.sleep(0.1)
        assert parts.replica.version == 1
        assert {s.policy_version for s in await collect(parts, request(n=1))} == {1}
        follower.cancel()
    finally:
        await client.aclose()
        await parts.heartbeat.stop()  # type: ignore[union-attr]
        await shutdown(parts)


async def test_min_policy_version_waits_for_the_update_then_is_served_by_it(
    tiny_model_dir: Path, tmp_path: Path, other_model: Path
) -> None:
    """A request for a version the replica does not hold yet waits for the update and carries the new
    version; one whose version never comes fails with FAILED_PRECONDITION, and the replica serves on."""
    parts = await started(config_for(tiny_model_dir, tmp_path / "weights", "min_version_wait_s=3"))
    await load_initial_weights(parts)
    try:
        req = request(n=1)
        req.min_policy_version = 1
        waiting = asyncio.get_running_loop().create_task(collect(parts, req))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # held: the replica serves version 0
        store.publish_version(str(tmp_path / "weights"), 1, state_dict_of(other_model))
        await stub(parts).UpdateWeights(update(1), metadata=AUTH, timeout=60)
        assert {s.policy_version for s in await asyncio.wait_for(waiting, 30)} == {1}
        never = request(n=1, request_id="r2")
        never.min_policy_version = 5
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(parts, never)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "min_policy_version" in (err.value.details() or "")
        assert {s.policy_version for s in await collect(parts, request(n=1, request_id="r3"))} == {1}
    finally:
        await shutdown(parts)
