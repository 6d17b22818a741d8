"""How a LoRA run's adapters reach the replicas: the spec's publish choice, the replica settings `up`
derives from it, and the adapter a generation request names."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from rlfabric.coordinator.dispatch import Dispatcher
from rlfabric.local.replicas import adapter_settings, adapter_slot_rank, check_adapters
from rlfabric.runspec import RunSpec


def spec(lora: dict[str, Any] | None, **sections: Any) -> RunSpec:
    raw = {"model": {"path": "m", "lora": lora}, "dataset": {"path": "d.jsonl"}, **sections}
    return RunSpec.model_validate(raw)


def test_adapter_publishing_is_the_default_and_needs_the_object_store() -> None:
    assert spec({"rank": 8}).model.lora.publish == "adapter"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"model\.lora\.publish: 'adapter' needs"):
        spec({"rank": 8}, weights={"transport": "broadcast"})
    assert spec({"rank": 8, "publish": "merged"}, weights={"transport": "broadcast"}).model.lora is not None


@pytest.mark.parametrize(("rank", "slot"), [(1, 1), (4, 8), (8, 8), (16, 16), (17, 32), (512, 512)])
def test_replica_slots_take_the_smallest_vllm_rank_that_holds_the_adapter(rank: int, slot: int) -> None:
    assert adapter_slot_rank(rank) == slot
    settings = adapter_settings(spec({"rank": rank}))
    assert settings == ["engine.max_adapters=1", f"engine.max_adapter_rank={slot}"]


def test_no_adapter_settings_without_adapter_publishing() -> None:
    assert adapter_settings(spec(None)) == []
    assert adapter_settings(spec({"rank": 8, "publish": "merged"})) == []


def test_up_refuses_adapters_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match=r"model\.lora\.rank: replicas serve adapters up to rank 512"):
        check_adapters(argparse.Namespace(engine="vllm"), spec({"rank": 1024}))
    with pytest.raises(ValueError, match="--engine transformers serves no LoRA adapters"):
        check_adapters(argparse.Namespace(engine="transformers"), spec({"rank": 8}))
    check_adapters(argparse.Namespace(engine="transformers"), spec({"rank": 8, "publish": "merged"}))


class _Run:
    """What `Dispatcher.adapter_for` reads."""

    def __init__(self, run_spec: RunSpec) -> None:
        self.spec, self.run_id = run_spec, "run-a"


@pytest.mark.parametrize(
    ("lora", "version", "adapter"),
    [
        ({"rank": 8}, 0, ""),  # version 0 of an adapter is the base (B = 0)
        ({"rank": 8}, 3, "run-a"),
        ({"rank": 8, "publish": "merged"}, 3, ""),
        (None, 3, ""),
    ],
)
def test_requests_name_the_runs_adapter_once_one_is_published(
    lora: dict[str, Any] | None, version: int, adapter: str
) -> None:
    assert Dispatcher.adapter_for(_Run(spec(lora)), version) == adapter  # type: ignore[arg-type]
