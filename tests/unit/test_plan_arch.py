"""`ModelArch.params()` equals the parameter count of the model transformers builds from the same config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfabric.plan.arch import ModelArch, UnsupportedModel
from rlfabric.tools.tiny_model import PRESETS, TinyModelSpec, model_config

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "vocab_size": 101,
}
"""A small decoder shape the other configs extend."""


def built_params(config: dict[str, Any]) -> int:
    """Parameters of the causal LM transformers builds from `config` (a config.json dict)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config["model_type"]
    hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tiny_presets_match_the_built_model(preset: str) -> None:
    spec = PRESETS[preset]
    config = model_config(spec).to_dict()
    assert ModelArch.from_config(config).params() == built_params(config) == spec.num_parameters()


def test_gqa_tiny_model_matches(tmp_path: Path) -> None:
    config = model_config(TinyModelSpec(hidden=128, heads=4, kv_heads=2, layers=3)).to_dict()
    assert ModelArch.from_config(config).params() == built_params(config)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False},
        {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True},
        {"model_type": "llama", **SMALL, "head_dim": 32, "tie_word_embeddings": True},
        {"model_type": "mistral", **SMALL, "num_key_value_heads": 1},
        {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False},
        {"model_type": "qwen3", **SMALL, "num_key_value_heads": 2, "head_dim": 32},
        {"model_type": "mixtral", **SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
        {
            "model_type": "qwen3_moe",
            **SMALL,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "head_dim": 16,
        },
    ],
    ids=lambda c: f"{c['model_type']}-{len(c)}",
)
def test_llama_family_configs_match(config: dict[str, Any]) -> None:
    assert ModelArch.from_config(config).params() == built_params(config)


def test_reads_a_model_folder_and_a_file(tmp_path: Path) -> None:
    config = {"model_type": "llama", **SMALL, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_folder = ModelArch.from_config(tmp_path)
    assert from_folder == ModelArch.from_config(tmp_path / "config.json") == ModelArch.from_config(config)
    assert from_folder.num_key_value_heads == 4 and from_folder.head_dim == 16
    assert from_folder.torch_dtype == "bfloat16" and from_folder.dtype_bytes == 2


def test_unsupported_shapes_name_the_field() -> None:
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2'"):
        ModelArch.from_config({"model_type": "gpt2", **SMALL})
    with pytest.raises(UnsupportedModel, match="intermediate_size"):
        ModelArch.from_config(
            {"model_type": "llama", **{k: v for k, v in SMALL.items() if k != "intermediate_size"}}
        )
    with pytest.raises(UnsupportedModel, match="shared_expert_intermediate_size"):
        ModelArch.from_config({"model_type": "qwen3_moe", **SMALL, "shared_expert_intermediate_size": 8})


def test_importing_the_planner_does_not_import_torch() -> None:
    code = "import sys, rlfabric.plan, rlfabric.plan.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_llama_2_7b_from_its_config_alone() -> None:
    """Llama-2-7B's config.json numbers give its well-known 6,738,415,616 parameters, with no weights."""
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    arch = ModelArch.from_config(config)
    assert arch.params() == 6_738_415_616
    assert arch.dtype_bytes == 2
