"""The planner's LoRA adapter sizes against the adapters PEFT really adds to the model transformers builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfabric.plan.arch import ModelArch
from rlfabric.plan.lora import adapter_params
from rlfabric.runspec import LoraSpec


@pytest.mark.parametrize(
    "targets",
    [
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ["q_proj", "v_proj"],
        ["all-linear"],
    ],
)
@pytest.mark.parametrize("rank", [1, 8])
def test_adapter_params_match_peft(tiny_model_dir: Path, targets: list[str], rank: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraSpec(rank=rank, target_modules=targets)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    target: str | list[str] = "all-linear" if targets == ["all-linear"] else targets
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert adapter_params(ModelArch.from_config(tiny_model_dir), lora) == trainable


def test_an_example_model_adapter_is_a_small_fraction() -> None:
    arch = ModelArch.from_config(Path(__file__).parents[2] / "examples" / "models" / "qwen2.5-7b")
    count = adapter_params(arch, LoraSpec(rank=16))
    assert 0.001 < count / arch.params() < 0.01  # rank-16 adapters on every projection of a 7B: ~0.5 %
