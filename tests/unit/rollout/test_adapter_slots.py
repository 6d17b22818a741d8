"""A replica's LoRA adapter slots, on a fake engine: capacity, versions per adapter, admission, unloading,
and the replica config's LoRA fields."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from rlfabric.rollout.config import EngineConfig
from rlfabric.rollout.engine import AdapterRef, Engine, EngineSample, EngineStats, SamplingSettings
from rlfabric.rollout.replica import Limits, Replica
from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

SAMPLING = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=4)


class FakeEngine(Engine):
    """Yields one sample per prompt once `release` is set (or at once); records adapter loads."""

    kind = "fake"
    max_model_len = 64
    vocab_size = 16

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters
        self.loaded: dict[str, AdapterRef] = {}
        self.used: list[AdapterRef | None] = []
        self.aborted: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    async def generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        adapter: AdapterRef | None = None,
    ) -> AsyncIterator[EngineSample]:
        self.used.append(adapter)
        await self.release.wait()
        for p, prompt in enumerate(prompts):
            reason = "abort" if request_id in self.aborted else "length"
            yield EngineSample(p, 0, prompt, [1], [-0.5], "x", reason, 0.0, 0.0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.release.set()

    async def load_adapter(self, adapter: AdapterRef) -> None:
        if "bad" in adapter.path:
            raise ValueError("rank too high")
        self.loaded[adapter.name] = adapter

    async def unload_adapter(self, name: str) -> None:
        del self.loaded[name]

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def tokenize_text(self, text: str) -> list[int]:
        return [1]

    def tokenize_chat(self, messages: Any, template_kwargs: Any = None) -> list[int]:
        return [1]

    async def load_weights_dir(self, path: str) -> None: ...
    async def receive_broadcast(self, plan: Any) -> None: ...
    async def reset_prefix_cache(self) -> None: ...
    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0)


def replica_with(max_adapters: int) -> Replica:
    limits = Limits(max_in_flight=8, max_n=4, max_tokens=8, max_prompts=4, min_version_wait_s=0.2)
    replica = Replica(FakeEngine(max_adapters), limits)
    replica.start_serving(0, restore=lambda: asyncio.sleep(0))
    return replica


async def load(replica: Replica, name: str, version: int, path: str = "") -> Any:
    return await replica.update_adapter(
        name, version, path or f"/a/{name}/{version}", abort_in_flight=False, timeout_s=5
    )


async def generate(replica: Replica, request_id: str, adapter: str = "", min_version: int = 0) -> list[int]:
    stream = replica.generate(request_id, [[1, 2]], SAMPLING, min_version, adapter)
    return [version async for _, version in stream]


async def test_adapters_serve_beside_the_base_with_their_own_versions() -> None:
    replica = replica_with(2)
    engine = replica.engine
    assert isinstance(engine, FakeEngine)
    await load(replica, "a", 3)
    assert await generate(replica, "r1", "a") == [3]
    assert await generate(replica, "r2") == [0]  # the base keeps its own version
    assert engine.used == [AdapterRef("a", 3, "/a/a/3"), None]
    assert await load(replica, "a", 3) is None  # the same version again: a no-op
    with pytest.raises(FailedPrecondition, match="older"):
        await load(replica, "a", 2)
    await load(replica, "a", 4)
    assert await generate(replica, "r3", "a", min_version=4) == [4]
    with pytest.raises(FailedPrecondition, match="min_policy_version"):
        await generate(replica, "r4", "a", min_version=5)


async def test_a_full_replica_refuses_a_new_name_and_evicts_nothing() -> None:
    replica = replica_with(2)
    await load(replica, "a", 1)
    await load(replica, "b", 1)
    with pytest.raises(ResourceExhausted, match="max_adapters"):
        await load(replica, "c", 1)
    assert [s.name for s in replica.adapters.all()] == ["a", "b"]
    await load(replica, "a", 2)  # a held name still updates
    assert await replica.unload_adapter("a", timeout_s=5) == (2, 0)
    await load(replica, "c", 1)
    assert [s.name for s in replica.adapters.all()] == ["b", "c"]


async def test_unknown_adapter_and_replica_without_lora() -> None:
    with pytest.raises(NotFound, match="'nope'"):
        await generate(replica_with(2), "r", "nope")
    without = replica_with(0)
    with pytest.raises(FailedPrecondition, match="without LoRA"):
        await generate(without, "r", "a")
    with pytest.raises(FailedPrecondition, match="without LoRA"):
        await load(without, "a", 1)
    with pytest.raises(InvalidArgument, match="valid name"):
        await load(replica_with(2), "../x", 1)


async def test_a_refused_first_version_frees_the_slot_and_a_refused_update_keeps_the_old() -> None:
    replica = replica_with(1)
    with pytest.raises(FailedPrecondition, match="refused"):
        await load(replica, "a", 1, path="/bad")
    assert replica.adapters.all() == []
    await load(replica, "a", 1)
    with pytest.raises(FailedPrecondition, match="refused"):
        await load(replica, "a", 2, path="/bad")
    assert await generate(replica, "r", "a") == [1]


async def test_unload_aborts_the_adapters_requests_and_spares_the_others() -> None:
    replica = replica_with(2)
    engine = replica.engine
    assert isinstance(engine, FakeEngine)
    await load(replica, "a", 1)
    engine.release.clear()
    running = asyncio.create_task(generate(replica, "on-a", "a"))
    await asyncio.sleep(0.01)
    assert replica.adapters.all()[0].in_flight == 1
    assert await replica.unload_adapter("a", timeout_s=5) == (1, 1)
    assert await running == [1] and engine.aborted == ["on-a"]
    assert replica.in_flight == 0 and "a" not in engine.loaded
    with pytest.raises(NotFound):
        await generate(replica, "r", "a")


def test_config_lora_fields() -> None:
    assert EngineConfig(model="m").max_adapters == 0
    config = EngineConfig(model="m", max_adapters=4, max_adapter_rank=32)
    assert (config.max_adapters, config.max_adapter_rank) == (4, 32)
    with pytest.raises(ValidationError, match="max_adapter_rank"):
        EngineConfig(model="m", max_adapters=1, max_adapter_rank=12)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="max_adapters"):
        EngineConfig(model="m", max_adapters=-1)
    with pytest.raises(ValidationError, match="need engine\\.kind"):
        EngineConfig(model="m", kind="transformers", max_adapters=1)


class FakeDriver:
    """Plays one model turn per trajectory through `generate_turn` (what `TrajectoryDriver` calls)."""

    def __init__(self, replica: Replica) -> None:
        self.generate_turn: Any = replica.engine_turn

    async def play(self, play_id: str, task: Any, sampling: Any, template_kwargs: Any, seed: Any) -> Any:
        return await self.generate_turn(f"{play_id}/turn0", [1, 2], sampling)


async def test_multi_turn_on_an_adapter_generates_every_turn_with_it() -> None:
    from rlfabric.rollout.replica import PlayTask

    replica = replica_with(2)
    engine = replica.engine
    assert isinstance(engine, FakeEngine)
    await load(replica, "a", 5)
    tasks = [PlayTask({"t": 1}), PlayTask({"t": 2})]
    stream = replica.play("mt", tasks, SAMPLING, FakeDriver(replica), 0, "a")  # type: ignore[arg-type]
    versions = [version async for _, _, _, version in stream]
    assert versions == [5, 5]
    assert engine.used == [AdapterRef("a", 5, "/a/a/5")] * 2
    assert replica.adapters.all()[0].in_flight == 0 and replica.in_flight == 0


async def test_the_runs_own_adapter_is_awaited_and_others_are_not() -> None:
    replica = replica_with(2)
    replica.awaited_adapter = "run"
    waiting = asyncio.create_task(generate(replica, "r1", "run", min_version=1))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await load(replica, "run", 1)
    assert await waiting == [1]
    with pytest.raises(NotFound):
        await generate(replica, "r2", "other")
    replica.awaited_adapter = "late"
    with pytest.raises(NotFound, match="'late'"):  # after min_version_wait_s (0.2 s here)
        await generate(replica, "r3", "late")
