"""Which engine `rlfabric up --compile` starts as the stand-in that serves while vLLM compiles, and the
transformers engine's batching setting."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from rlfabric.local.replicas import stand_in_engine
from rlfabric.rollout.config import EngineConfig

LORA = ["run_id=demo", "engine.max_adapters=1", "engine.max_adapter_rank=16"]


def test_a_single_turn_full_weight_run_gets_the_transformers_stand_in() -> None:
    args = argparse.Namespace(stand_in="transformers")
    assert stand_in_engine(args, ["run_id=demo"], None) == "transformers"


def test_adapters_multi_turn_or_the_option_keep_the_vllm_stand_in() -> None:
    default = argparse.Namespace(stand_in="transformers")
    assert stand_in_engine(default, LORA, None) == "vllm"
    assert stand_in_engine(default, ["run_id=demo"], "127.0.0.1:5000") == "vllm"
    assert stand_in_engine(argparse.Namespace(stand_in="vllm"), ["run_id=demo"], None) == "vllm"
    assert stand_in_engine(argparse.Namespace(), ["run_id=demo"], None) == "transformers"  # saved before


def test_batch_prompts_is_the_transformers_engines() -> None:
    assert EngineConfig(model="m", kind="transformers", batch_prompts=64).batch_prompts == 64
    with pytest.raises(ValidationError, match="batch_prompts: only the transformers engine"):
        EngineConfig(model="m", kind="vllm", batch_prompts=2)
    with pytest.raises(ValidationError, match="batch_prompts"):
        EngineConfig(model="m", kind="transformers", batch_prompts=0)
