"""A fleet replica's follow loop (`rlfabric.rollout.fleet`) on a fake engine and an in-memory Redis: the
real replica, servicer and weights source load adapter versions published in real weights roots as the
fleet's members announce them, unload the adapters of runs that left, skip failed versions, wait for
slots, survive Redis errors; the registry entry lists the adapters; and the `fleet` setting's rules."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch

from rlfabric.contracts import fleet, keys, registry
from rlfabric.contracts.fleet import FleetMember
from rlfabric.rollout.config import RolloutServiceConfig
from rlfabric.rollout.engine import AdapterRef, Engine, EngineSample, EngineStats, SamplingSettings
from rlfabric.rollout.fleet import FleetFollower
from rlfabric.rollout.main import Parts, registry_scope
from rlfabric.rollout.replica import Limits, Replica
from rlfabric.rollout.server import RolloutServicer
from rlfabric.rollout.weights_source import WeightsSource
from rlfabric.runtime.config import ConfigError, load_config
from rlfabric.runtime.errors import NotFound
from rlfabric.weights.adapters import publish_adapter
from rlfabric.weights.versions import publish_version

FLEET = "shared"
SAMPLING = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=4)


class FakeEngine(Engine):
    """Yields one sample per prompt; records the adapters loaded and unloaded."""

    kind = "fake"
    max_model_len = 64
    vocab_size = 16

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters
        self.loaded: dict[str, AdapterRef] = {}
        self.loads: list[tuple[str, int]] = []
        self.unloads: list[str] = []

    async def generate(
        self, request_id: str, prompts: list[list[int]], sampling: SamplingSettings,
        adapter: AdapterRef | None = None,
    ) -> AsyncIterator[EngineSample]:  # fmt: skip
        for p, prompt in enumerate(prompts):
            yield EngineSample(p, 0, prompt, [1], [-0.5], "x", "length", 0.0, 0.0)

    async def load_adapter(self, adapter: AdapterRef) -> None:
        self.loaded[adapter.name] = adapter
        self.loads.append((adapter.name, adapter.version))

    async def unload_adapter(self, name: str) -> None:
        del self.loaded[name]
        self.unloads.append(name)

    async def abort(self, request_id: str) -> None: ...
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


class BrokenRedis:
    """A Redis that is down."""

    async def hgetall(self, key: str) -> Any:
        raise ConnectionError("redis is down")


async def noop() -> None: ...


def servicer_with(max_adapters: int, tmp_path: Path) -> RolloutServicer:
    engine = FakeEngine(max_adapters)
    limits = Limits(max_in_flight=8, max_n=4, max_tokens=8, max_prompts=4, min_version_wait_s=5.0)
    replica = Replica(engine, limits)
    replica.start_serving(0, restore=noop)
    weights = WeightsSource(engine, base_model_dir=str(tmp_path / "base"), root_url=None)
    return RolloutServicer(
        replica, weights, replica_id="r0", address="127.0.0.1:1", model="m", learner_token=None,
        update_timeout_s=5.0, on_serving_change=lambda serving: noop(),
    )  # fmt: skip


def publish(root: Path, version: int) -> None:
    """A (meaningless, tiny) LoRA adapter version: the fake engine loads any."""
    tensors = {"base_model.model.layer.q_proj.lora_A.weight": torch.full((2, 4), float(version))}
    publish_adapter(root, version, tensors, {"r": 2, "peft_type": "LORA"})


async def join(redis: Any, tmp_path: Path, run: str, version: int) -> FleetMember:
    """Run `run` joins the fleet with adapter version `version` published and announced."""
    member = FleetMember(run, run, str(tmp_path / run), 1.0)
    if version:
        publish(tmp_path / run, version)
        await redis.set(keys.version(run), version)
    await fleet.join(redis, FLEET, member)
    return member


async def announce(redis: Any, tmp_path: Path, run: str, version: int) -> None:
    publish(tmp_path / run, version)
    await redis.set(keys.version(run), version)


def held(servicer: RolloutServicer) -> dict[str, int | None]:
    return {s.name: s.version for s in servicer.replica.adapters.all()}


@pytest.fixture
def redis() -> Any:
    return fakeredis.FakeAsyncRedis()


async def test_members_adapters_load_follow_newer_versions_and_unload_when_their_run_leaves(
    redis: Any, tmp_path: Path
) -> None:
    servicer = servicer_with(3, tmp_path)
    changes: list[int] = []

    async def changed() -> None:
        changes.append(len(servicer.replica.adapters.all()))

    follower = FleetFollower(FLEET, redis, servicer, changed)
    await join(redis, tmp_path, "run-a", 1)
    await join(redis, tmp_path, "run-b", 2)
    await join(redis, tmp_path, "run-c", 0)  # nothing announced yet: nothing to load
    await follower.poll()
    assert held(servicer) == {"run-a": 1, "run-b": 2}
    assert servicer.replica.awaited_adapters == {"run-a", "run-b", "run-c"}
    assert changes == [2]

    await follower.poll()  # nothing new: no load, no beat
    assert changes == [2]
    await announce(redis, tmp_path, "run-a", 3)
    await follower.poll()
    assert held(servicer) == {"run-a": 3, "run-b": 2}

    await fleet.leave(redis, FLEET, "run-b")
    await follower.poll()
    assert held(servicer) == {"run-a": 3}
    engine = servicer.replica.engine
    assert isinstance(engine, FakeEngine)
    assert engine.unloads == ["run-b"] and "run-b" not in engine.loaded
    assert servicer.replica.awaited_adapters == {"run-a", "run-c"}
    assert engine.loads == [("run-a", 1), ("run-b", 2), ("run-a", 3)]
    assert not list((servicer.weights._scratch / "adapters" / "run-b").iterdir())  # its folder deleted


async def test_a_failed_version_is_skipped_until_a_newer_one_is_announced(
    redis: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    servicer = servicer_with(2, tmp_path)
    follower = FleetFollower(FLEET, redis, servicer)
    await join(redis, tmp_path, "run-a", 1)
    await follower.poll()
    weights = {"w": torch.zeros(2)}
    publish_version(str(tmp_path / "run-a"), 2, weights)  # full weights, not an adapter: refused
    await redis.set(keys.version("run-a"), 2)
    with caplog.at_level(logging.ERROR, logger="rlfabric.rollout.fleet"):
        await follower.poll()
        await follower.poll()
    assert len([r for r in caplog.records if "version 2" in r.getMessage()]) == 1  # tried once
    assert held(servicer) == {"run-a": 1}  # the old version serves on
    await announce(redis, tmp_path, "run-a", 3)
    await follower.poll()
    assert held(servicer) == {"run-a": 3}


async def test_a_member_without_a_free_slot_is_logged_once_and_loaded_when_one_frees(
    redis: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    servicer = servicer_with(1, tmp_path)
    follower = FleetFollower(FLEET, redis, servicer)
    await join(redis, tmp_path, "run-a", 1)
    await join(redis, tmp_path, "run-b", 1)
    with caplog.at_level(logging.WARNING, logger="rlfabric.rollout.fleet"):
        for _ in range(3):
            await follower.poll()
    assert held(servicer) == {"run-a": 1}
    assert len([r for r in caplog.records if "no free adapter slot for run run-b" in r.getMessage()]) == 1
    await fleet.leave(redis, FLEET, "run-a")
    await follower.poll()  # unloads run-a first, then loads run-b into the freed slot
    assert held(servicer) == {"run-b": 1}


async def test_a_redis_error_is_logged_and_the_next_poll_reads_again(
    redis: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    servicer = servicer_with(2, tmp_path)
    follower = FleetFollower(FLEET, BrokenRedis(), servicer)
    with caplog.at_level(logging.WARNING, logger="rlfabric.rollout.fleet"):
        await follower.poll()
    assert any("could not read the members" in r.getMessage() for r in caplog.records)
    await join(redis, tmp_path, "run-a", 1)
    follower.redis = redis  # Redis is back
    await follower.poll()
    assert held(servicer) == {"run-a": 1}


async def test_adapters_loaded_otherwise_are_left_alone(redis: Any, tmp_path: Path) -> None:
    servicer = servicer_with(2, tmp_path)
    follower = FleetFollower(FLEET, redis, servicer)
    publish(tmp_path / "manual", 1)
    await servicer.update(update_request("manual", 1, tmp_path / "manual"))
    await join(redis, tmp_path, "run-a", 1)
    await follower.poll()
    await fleet.leave(redis, FLEET, "run-a")
    await follower.poll()
    assert held(servicer) == {"manual": 1}


def update_request(name: str, version: int, root: Path) -> Any:
    from rlfabric.v1 import rollout_pb2

    source = rollout_pb2.ObjectStoreSource(root_url=str(root))
    return rollout_pb2.UpdateWeightsRequest(version=version, adapter=name, object_store=source)


async def generate(replica: Replica, request_id: str, adapter: str) -> list[int]:
    stream = replica.generate(request_id, [[1, 2]], SAMPLING, 0, adapter)
    return [version async for _, version in stream]


async def test_a_request_on_a_members_adapter_waits_for_its_load_others_are_not_found(
    redis: Any, tmp_path: Path
) -> None:
    servicer = servicer_with(2, tmp_path)
    follower = FleetFollower(FLEET, redis, servicer)
    await join(redis, tmp_path, "run-a", 0)
    await follower.poll()  # a member, nothing announced yet
    waiting = asyncio.create_task(generate(servicer.replica, "r1", "run-a"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await announce(redis, tmp_path, "run-a", 1)
    await follower.poll()
    assert await asyncio.wait_for(waiting, 5) == [1]
    with pytest.raises(NotFound, match="'run-z'"):
        await asyncio.wait_for(generate(servicer.replica, "r2", "run-z"), 1)


async def test_the_registry_entry_lists_the_adapters_under_the_fleets_scope(
    redis: Any, tmp_path: Path
) -> None:
    servicer = servicer_with(2, tmp_path)
    config = RolloutServiceConfig.model_validate(
        {"engine": {"model": "m", "max_adapters": 2}, "fleet": FLEET, "redis": {"url": "redis://x"}}
    )
    parts = Parts(config, servicer.replica.engine, servicer.replica, servicer.weights, server=None)  # type: ignore[arg-type]
    parts.replica_id, parts.address = "r0", "127.0.0.1:1"
    heartbeat = registry.Heartbeat(redis, registry_scope(config), parts.entry, interval_s=60)
    follower = FleetFollower(FLEET, redis, servicer, heartbeat.beat)
    await join(redis, tmp_path, "run-a", 2)
    await join(redis, tmp_path, "run-b", 1)
    await follower.poll()
    (entry,) = await registry.discover(redis, keys.fleet_scope(FLEET))
    assert entry.adapter_versions() == {"run-a": 2, "run-b": 1}
    assert json.loads(entry.adapters) == {"run-a": 2, "run-b": 1}
    assert await registry.discover(redis, None) == []


def test_an_unbound_replicas_entry_lists_no_adapters(tmp_path: Path) -> None:
    servicer = servicer_with(0, tmp_path)
    config = RolloutServiceConfig.model_validate({"engine": {"model": "m"}})
    parts = Parts(config, servicer.replica.engine, servicer.replica, servicer.weights, server=None)  # type: ignore[arg-type]
    assert parts.entry().adapter_versions() == {}
    assert registry_scope(config) is None


SETTINGS = {
    "engine.model": "m",
    "engine.max_adapters": "2",
    "fleet": FLEET,
    "redis.url": "redis://127.0.0.1:1",
}


def config_of(settings: dict[str, str | None]) -> RolloutServiceConfig:
    overrides = [f"{k}={v}" for k, v in settings.items() if v is not None]
    return load_config(RolloutServiceConfig, overrides=overrides)


def test_a_fleet_replica_registers_under_the_fleets_scope() -> None:
    config = config_of(SETTINGS)
    assert config.fleet == FLEET and registry_scope(config) == keys.fleet_scope(FLEET)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"run_id": "run-a"}, "run_id"),
        ({"weights_root": "/w"}, "weights_root"),
        ({"engine.max_adapters": "0"}, "engine.max_adapters"),
        ({"redis.url": None}, "redis.url"),
        ({"fleet": "a:b"}, "fleet"),
    ],
)
def test_the_fleet_setting_refuses_what_it_excludes(change: dict[str, str | None], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_of({**SETTINGS, **change})
