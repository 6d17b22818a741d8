"""The final model of an offline run as a Hugging Face folder, which a later run's `model.path` loads
with transformers and vLLM (the online run after a warm start, `rlfabric.local.warm_start`):

    <run dir>/model/config.json                      the base model's (`model.path`), and its
                    generation_config.json           generation settings when it has them
                    tokenizer files                  the base model's tokenizer (chat template included)
                    model-0000i-of-0000n.safetensors the trained weights (float32, as trained)
                    model.safetensors.index.json     which file holds each tensor
                    COMMITTED                        written last

Rank 0 writes it into `model.partial/` (a leftover one is replaced), syncs every file, writes the marker
and renames the folder, so a crash leaves either no `model/` or a complete one: `is_committed` is the
test `up --resume` uses to reuse a finished warm start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rlfabric.weights.shards import plan_shards, write_shards
from rlfabric.weights.store import LocalStore

if TYPE_CHECKING:
    import torch

MODEL_DIR = "model"
"""The final model's folder in the run directory."""
MARKER = "COMMITTED"
"""Written last into the final model's folder."""
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 << 30
"""Largest safetensors file of the final model (transformers' own default size)."""


def drop_tied_head(config: object, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` as checkpoints name it: without `lm_head.weight` when the model ties it to the
    embeddings (`save_pretrained` leaves it out, and a replica checks published names against the base
    checkpoint's). Returns the same dict."""
    if getattr(config, "tie_word_embeddings", False):
        state_dict.pop("lm_head.weight", None)
    return state_dict


def final_model_dir(run_dir: str | Path) -> Path:
    """Where a run in `run_dir` leaves its final model (an online run's learner too, at its end)."""
    return Path(run_dir) / MODEL_DIR


def is_committed(model_dir: str | Path) -> bool:
    """Whether the final model in `model_dir` was written completely."""
    return (Path(model_dir) / MARKER).is_file()


def export_final_model(state_dict: Mapping[str, torch.Tensor], base_model: str, run_dir: str | Path) -> Path:
    """Write `state_dict` with `base_model`'s config and tokenizer as the run's final model; returns it."""
    final = final_model_dir(run_dir)
    partial = final.with_name(f"{MODEL_DIR}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    write_weights(state_dict, partial)
    write_model_files(base_model, partial)
    commit(partial, final)
    return final


def write_weights(state_dict: Mapping[str, torch.Tensor], folder: Path) -> None:
    """The tensors as safetensors shards and their index (every name its own bytes: tied weights too)."""
    shards = plan_shards(state_dict, SHARD_BYTES)
    entries, _ = write_shards(LocalStore(str(folder)), str(folder), shards)
    weight_map = {name: shard.name for shard in shards for name, _ in shard.tensors}
    index = {"metadata": {"total_size": sum(e.size for e in entries)}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))


def write_model_files(base_model: str, folder: Path) -> None:
    """The base model's config, generation settings (when it has them) and tokenizer into `folder`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    AutoConfig.from_pretrained(base_model).save_pretrained(folder)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(folder)
    with contextlib.suppress(OSError):  # tolerated: a model without generation_config.json has none
        GenerationConfig.from_pretrained(base_model).save_pretrained(folder)


def commit(partial: Path, final: Path) -> None:
    """Sync every file of `partial`, write the marker, and rename it to `final` (replacing an old one)."""
    for path in partial.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    with (partial / MARKER).open("w") as marker:
        marker.write("complete\n")
        marker.flush()
        os.fsync(marker.fileno())
    sync_dir(partial)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    sync_dir(final.parent)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
