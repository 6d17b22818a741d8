"""Published LoRA adapters: publish -> materialize -> PEFT loads the folder and computes what the adapter
it came from computes; full-weight versions are refused as adapters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.weights.adapters import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    NotAnAdapter,
    is_adapter_version,
    materialize_adapter,
    publish_adapter,
)
from rlfabric.weights.versions import (
    VersionConflict,
    WeightsCorrupted,
    publish_version,
    read_manifest,
    version_dir,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=1, hidden=64, heads=2)


def peft_model(model_dir: Path, seed: int) -> Any:
    """The tiny model with a random, non-zero LoRA adapter on q_proj and down_proj."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(base, config)


def adapter_of(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """PEFT's saved-adapter tensors and adapter_config.json content."""
    from peft import get_peft_model_state_dict

    config = model.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return get_peft_model_state_dict(model), config


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 4, 5, 6, 7]])).logits  # (1, 5, V)


def test_round_trip_loads_in_peft_and_matches(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = peft_model(model_dir, seed=1)
    state, config = adapter_of(source)
    assert all(".default." not in name for name in state)  # PEFT's saved names: no adapter name
    root = tmp_path / "weights"
    published = publish_adapter(root, 1, state, config, metadata={"step": 7})
    manifest = read_manifest(root, 1)
    assert published.version == 1 and is_adapter_version(manifest)
    assert manifest.metadata["step"] == 7 and manifest.metadata["peft_config"]["r"] == 4

    folder = materialize_adapter(root, 1, tmp_path / "adapter")
    assert json.loads((folder / ADAPTER_CONFIG_FILE).read_text()) == config
    assert (folder / ADAPTER_WEIGHTS_FILE).is_file()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(folder))
    assert torch.allclose(logits(loaded), logits(source), atol=1e-6)
    with source.disable_adapter():
        assert not torch.allclose(logits(loaded), logits(source), atol=1e-3)  # the adapter does something


def test_versions_increase_per_root(model_dir: Path, tmp_path: Path) -> None:
    state, config = adapter_of(peft_model(model_dir, seed=2))
    publish_adapter(tmp_path, 3, state, config)
    with pytest.raises(VersionConflict):
        publish_adapter(tmp_path, 3, state, config)


def test_full_weights_are_not_an_adapter(model_dir: Path, tmp_path: Path) -> None:
    publish_version(tmp_path, 1, {"w": torch.ones(2, 2)})
    assert not is_adapter_version(read_manifest(tmp_path, 1))
    with pytest.raises(NotAnAdapter, match="not a LoRA adapter") as info:
        materialize_adapter(tmp_path, 1, tmp_path / "out")
    assert isinstance(info.value, FailedPrecondition)
    assert not (tmp_path / "out").exists()


def test_corrupted_adapter_is_refused(model_dir: Path, tmp_path: Path) -> None:
    state, config = adapter_of(peft_model(model_dir, seed=3))
    publish_adapter(tmp_path, 1, state, config)
    shard = next(Path(version_dir(tmp_path, 1)).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsCorrupted):
        materialize_adapter(tmp_path, 1, tmp_path / "out")


def test_metadata_cannot_override_the_kind(model_dir: Path, tmp_path: Path) -> None:
    state, config = adapter_of(peft_model(model_dir, seed=4))
    with pytest.raises(InvalidArgument, match="kind"):
        publish_adapter(tmp_path, 1, state, config, metadata={"kind": "full"})
    with pytest.raises(InvalidArgument, match="empty"):
        publish_adapter(tmp_path, 1, {}, config)


def test_lora_tensor_names() -> None:
    from rlfabric.weights.adapters import adapter_names_problem

    assert adapter_names_problem(["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]) is None
    assert adapter_names_problem([]) == "no tensors"
    problem = adapter_names_problem(["x.lora_A.weight", "model.norm.weight"])
    assert problem is not None and "model.norm.weight" in problem
