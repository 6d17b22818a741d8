"""Published LoRA adapters: a version of a run's weights that holds an adapter, not the full model.

An adapter version is an ordinary published version (`rlfabric.weights.versions`: same layout,
manifest, per-file sha256, COMMITTED marker last, versions increasing per root) whose manifest metadata
says what it is::

    {"kind": "lora_adapter", "peft_config": <adapter_config.json content>, ...publisher's metadata}

Its tensors are named as PEFT saves an adapter (`peft.get_peft_model_state_dict`: the adapter's own
name dropped), e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. A replica turns a
version back into the folder PEFT and vLLM load (`adapter_config.json` + `adapter_model.safetensors`)
with `materialize_adapter`, which verifies every file first and refuses a full-weights version.

Imports without torch, like `versions` (torch and safetensors only inside the functions that need them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfabric.runtime.errors import InvalidArgument
from rlfabric.weights.versions import (
    Manifest,
    PublishedVersion,
    WeightsCorrupted,
    load_version,
    publish_version,
    read_manifest,
)

if TYPE_CHECKING:
    from torch import Tensor

ADAPTER_KIND = "lora_adapter"
"""`metadata[KIND_KEY]` of an adapter version."""
KIND_KEY = "kind"
PEFT_CONFIG_KEY = "peft_config"
"""`metadata[PEFT_CONFIG_KEY]`: the adapter's adapter_config.json content."""
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")
"""How the names of a saved PEFT LoRA adapter's tensors end."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""The two files of a PEFT adapter folder (what `PeftModel.from_pretrained` and vLLM's LoRA loader read)."""


def run_adapter_name(run_id: str) -> str:
    """The name a run's LoRA adapter has on the replicas: the run's id. The one definition the replica that
    follows the run (which loads it) and the coordinator (whose requests name it) share."""
    return run_id


class NotAnAdapter(WeightsCorrupted):
    """A version that is not a LoRA adapter (full weights, or metadata without a PEFT config) was asked
    for as one (FAILED_PRECONDITION)."""


def publish_adapter(
    root: str | os.PathLike[str],
    version: int,
    adapter_state: Mapping[str, Tensor],
    peft_config: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
) -> PublishedVersion:
    """Publishes `adapter_state` (PEFT's saved-adapter names) as version `version` under `root`, with
    `peft_config` (adapter_config.json content, JSON-serializable) in the manifest. `metadata` may not
    use the keys `kind` and `peft_config`. Raises `VersionConflict` as `publish_version` does."""
    extra = dict(metadata or {})
    clash = sorted({KIND_KEY, PEFT_CONFIG_KEY} & extra.keys())
    if clash:
        raise InvalidArgument(f"metadata: {clash} are set by publish_adapter")
    if not adapter_state:
        raise InvalidArgument("adapter_state: empty (no LoRA tensors to publish)")
    meta = {KIND_KEY: ADAPTER_KIND, PEFT_CONFIG_KEY: dict(peft_config), **extra}
    return publish_version(root, version, adapter_state, metadata=meta)


def is_adapter_version(manifest: Manifest) -> bool:
    """Whether the version `manifest` describes holds a LoRA adapter (and not full weights)."""
    return manifest.metadata.get(KIND_KEY) == ADAPTER_KIND


def adapter_config_of(manifest: Manifest) -> dict[str, Any]:
    """The adapter_config.json content of an adapter version; `NotAnAdapter` for any other version."""
    where = f"version {manifest.policy_version}"
    if not is_adapter_version(manifest):
        kind = manifest.metadata.get(KIND_KEY, "full weights")
        raise NotAnAdapter(f"{where} is not a LoRA adapter (metadata kind: {kind!r})")
    config = manifest.metadata.get(PEFT_CONFIG_KEY)
    if not isinstance(config, dict):
        raise NotAnAdapter(f"{where}: metadata has no {PEFT_CONFIG_KEY} object")
    return config


def materialize_adapter(root: str | os.PathLike[str], version: int, dest_dir: str | os.PathLike[str]) -> Path:
    """Verifies adapter version `version` under `root` (marker, manifest, every file's sha256) and writes
    it as a PEFT adapter folder at `dest_dir` (created if missing); returns that folder.

    Raises `NotAnAdapter` (a FAILED_PRECONDITION) for a version that is not an adapter,
    `VersionNotCommitted` or `WeightsCorrupted` as `versions.load_version` does. The weights file is
    written before the config, so a folder with a config is complete."""
    config = adapter_config_of(read_manifest(root, version))
    return write_adapter_folder(load_version(root, version, verify=True), config, dest_dir)


def write_adapter_folder(
    tensors: Mapping[str, Tensor], config: Mapping[str, Any], dest_dir: str | os.PathLike[str]
) -> Path:
    """Writes a PEFT adapter folder (weights first, then the config) at `dest_dir`; returns it."""
    from safetensors.torch import save_file

    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(dest / ADAPTER_WEIGHTS_FILE))
    (dest / ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(config), indent=1) + "\n")
    return dest


def adapter_names_problem(names: Iterable[str]) -> str | None:
    """Why tensors of these names are not a saved PEFT LoRA adapter (None when they are): every name
    must end in `LORA_SUFFIXES`."""
    names = list(names)
    if not names:
        return "no tensors"
    other = [n for n in names if not n.endswith(LORA_SUFFIXES)]
    return f"not LoRA adapter tensors: {other[:3]}" if other else None
