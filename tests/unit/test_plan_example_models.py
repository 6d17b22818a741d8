"""The architecture configs under examples/models/ match their models' published parameter counts (within
1 %, the figures cited in examples/models/README.md) and load as the hub's config.json would."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlfabric.plan.arch import ModelArch

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"
PUBLISHED = {
    "qwen2.5-0.5b": 0.49e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-72b": 72.7e9,
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "mistral-7b-v0.3": 7.25e9,
}
"""Published parameter counts (examples/models/README.md)."""


def test_every_folder_is_cited_in_the_readme() -> None:
    folders = {p.name for p in MODELS.iterdir() if (p / "config.json").is_file()}
    assert folders == set(PUBLISHED)
    cited = set(re.findall(r"^\| `([^`]+)` \|", (MODELS / "README.md").read_text(), flags=re.MULTILINE))
    assert cited == folders


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_params_match_the_published_count_within_1_percent(name: str) -> None:
    params = ModelArch.from_config(MODELS / name).params()
    assert params == pytest.approx(PUBLISHED[name], rel=0.01)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_config_has_the_fields_the_hub_gives(name: str) -> None:
    config = json.loads((MODELS / name / "config.json").read_text())
    needed = {"architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads"}
    needed |= {"num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings"}
    needed |= {"max_position_embeddings", "rope_theta", "torch_dtype", "rms_norm_eps"}
    assert needed <= set(config)
    assert config["torch_dtype"] == "bfloat16"
