"""Scale-in drains: a real `rlfabric serve rollout` process (reference engine) registered in a real Redis,
seen through the coordinator's ReplicaPool. On SIGTERM the replica announces `draining` at once (the pool
stops dispatching to it), refuses new requests, finishes the one it holds, then deregisters and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from rlfabric.contracts import registry
from rlfabric.coordinator.replicas import ReplicaPool
from rlfabric.coordinator.scaling import BusyMeter
from rlfabric.local.procs import ServiceProcess
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

RUN = "drain"


def start_replica(tmp_path: Path, model: Path, redis_url: str) -> tuple[ServiceProcess, str]:
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "rollout", "--model", str(model)]
    argv += ["--engine", "transformers", "--port", "0", "--insecure"]  # no weight updates here
    # drain_timeout_s: the held request may take minutes on a busy machine; the drain waits for it (its
    # limit is not what this module tests).
    settings = [f"run_id={RUN}", f"redis.url={redis_url}", "replica_id=r0", "heartbeat_s=0.5"]
    for setting in [*settings, "drain_timeout_s=300"]:
        argv += ["--set", setting]
    proc = ServiceProcess("r0", argv, log_path=tmp_path / "r0.log")
    address = proc.start(r"listening on (\S+)", timeout_s=120).group(1)
    proc.wait_for(r"serving version", timeout_s=120)
    return proc, address


def request(request_id: str, max_tokens: int) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=request_id,
        prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="say x"))],
        sampling=rollout_pb2.SamplingParams(n=4, max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
    )


async def entry(redis: aioredis.Redis) -> registry.ReplicaEntry | None:
    entries = await registry.discover(redis, RUN)
    return entries[0] if entries else None


async def eventually(check, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_sigterm_drains_the_replica_before_it_exits(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    proc, address = start_replica(tmp_path, tiny_model_dir, redis_url)
    redis = aioredis.Redis.from_url(redis_url)
    pool = ReplicaPool(redis, RUN, per_replica=4, meter=BusyMeter(10.0))
    await eventually(lambda: _registered(redis))
    await pool.refresh()
    assert pool.live == {address}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        held = asyncio.get_running_loop().create_task(_collect(stub.Generate(request("held", 600))))
        await eventually(lambda: _in_flight(redis))
        proc.signal(signal.SIGTERM)
        await eventually(lambda: _draining(redis), timeout_s=2.0)  # announced at once, not at a beat
        await pool.refresh()
        assert pool.live == set() and pool._best() is None  # nothing more is dispatched to it
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _collect(stub.Generate(request("new", 4)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in str(refused.value.details())
        samples = await asyncio.wait_for(held, 240)
    assert len(samples) == 4 and {len(s.token_ids) for s in samples} == {600}  # finished, not cut short
    assert await asyncio.to_thread(proc.proc.wait, 30) == 0  # type: ignore[union-attr]
    assert await entry(redis) is None  # deregistered
    await redis.aclose()


async def _collect(call: grpc.aio.UnaryStreamCall) -> list[rollout_pb2.GeneratedSample]:  # type: ignore[type-arg]
    return [s async for s in call]


async def _in_flight(redis: aioredis.Redis) -> bool:
    found = await entry(redis)
    return found is not None and found.in_flight > 0


async def _draining(redis: aioredis.Redis) -> bool:
    found = await entry(redis)
    return found is not None and found.draining


async def _registered(redis: aioredis.Redis) -> bool:
    return await entry(redis) is not None
