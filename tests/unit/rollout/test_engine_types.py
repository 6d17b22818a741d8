"""The engine data types and the weights-folder checks (pure, no model, no engine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlfabric.rollout.engine import (
    EngineSample,
    EngineStats,
    SamplingSettings,
    WeightsRejected,
    check_weights_dir,
    checkpoint_shapes,
    read_weights_dir,
)


def settings(**changes: object) -> SamplingSettings:
    base = SamplingSettings(n=2, temperature=1.0, top_p=1.0, top_k=0, max_tokens=8)
    return dataclasses.replace(base, **changes)


def test_sampling_settings_defaults_and_frozen() -> None:
    s = settings()
    assert (s.stop, s.seed, s.ignore_eos) == ((), None, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.n = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "change", [{"n": 0}, {"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_sampling_settings_rejects_impossible_values(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        settings(**change)


def test_sample_seeds_are_distinct_per_sample_and_none_when_unseeded() -> None:
    s = settings(n=3, seed=10)
    seeds = [s.sample_seed(p, i) for p in range(2) for i in range(3)]
    assert seeds == list(range(10, 16))
    assert settings().sample_seed(1, 1) is None


def test_sample_and_stats_are_plain_frozen_records() -> None:
    sample = EngineSample(0, 1, [1, 2], [3, 4], [-0.5, -1.0], "ab", "length", 0.1, 0.2)
    assert dataclasses.asdict(sample)["token_ids"] == [3, 4]
    stats = EngineStats(running=1, waiting=0, kv_cache_usage=0.5, tokens_generated=9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.running = 0  # type: ignore[misc]


def write(folder: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    folder.mkdir(exist_ok=True)
    save_file(tensors, folder / name)
    return folder


BASE = {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(3)}
EXPECTED = {"a.weight": (4, 3), "b.bias": (3,)}


def test_checkpoint_shapes_reads_headers_across_files(tmp_path: Path) -> None:
    write(tmp_path, {"a.weight": BASE["a.weight"]}, "model-1.safetensors")
    write(tmp_path, {"b.bias": BASE["b.bias"]}, "model-2.safetensors")
    assert checkpoint_shapes(tmp_path) == EXPECTED
    assert set(read_weights_dir(tmp_path)) == set(EXPECTED)


def test_matching_folder_passes_even_in_another_float_dtype(tmp_path: Path) -> None:
    check_weights_dir(write(tmp_path, {k: v.bfloat16() for k, v in BASE.items()}), EXPECTED)


@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        ({"a.weight": torch.zeros(4, 3)}, "missing ['b.bias']"),
        ({**BASE, "c": torch.zeros(1)}, "unexpected ['c']"),
        ({**BASE, "b.bias": torch.zeros(4)}, "b.bias: (4,) != (3,)"),
        ({**BASE, "b.bias": torch.zeros(3, dtype=torch.int64)}, "not floating point"),
    ],
)
def test_mismatched_folder_is_rejected(
    tmp_path: Path, tensors: dict[str, torch.Tensor], fragment: str
) -> None:
    with pytest.raises(WeightsRejected) as info:
        check_weights_dir(write(tmp_path, tensors), EXPECTED)
    assert fragment in str(info.value)


def test_empty_or_truncated_folder_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(WeightsRejected, match=r"no \.safetensors"):
        check_weights_dir(tmp_path, EXPECTED)
    path = write(tmp_path, BASE) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(WeightsRejected, match="truncated"):
        check_weights_dir(tmp_path, EXPECTED)


def test_duplicate_tensor_across_files_is_rejected(tmp_path: Path) -> None:
    write(tmp_path, BASE, "model-1.safetensors")
    write(tmp_path, {"b.bias": BASE["b.bias"]}, "model-2.safetensors")
    with pytest.raises(WeightsRejected, match="more than one file"):
        checkpoint_shapes(tmp_path)
