"""LoRA on the learner: adapters on a frozen policy, the reference as the policy with its adapters off,
and the merged weights the replicas serve.

- `add_adapters` wraps a freshly loaded causal LM in PEFT's LoRA (before FSDP shards it): only the
  adapters require gradients, so the optimizer holds state for them alone.
- `AdaptersDisabled` is the KL reference without a second copy of the model: its forward runs the
  policy's under PEFT's `disable_adapter()`, i.e. the frozen base weights.
- `merged_state_dict` turns the policy's full state dict (PEFT's key names) into the plain model's
  (Hugging Face names, each adapted weight W replaced by W + (alpha / r) B A), which the weight store and
  the replicas take like any full version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rlfabric.runspec import LoraSpec

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the wrapped model's own parameter names."""
BASE_LAYER = ".base_layer"
"""The infix of an adapted layer's frozen weights (`...q_proj.base_layer.weight`)."""
ADAPTER = "default"
"""The one adapter's name (PEFT's default)."""


def add_adapters(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """`model` wrapped in LoRA adapters per `lora`; the base weights frozen, the adapters trainable."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = "all-linear" if lora.target_modules == ["all-linear"] else lora.target_modules
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER)  # type: ignore[arg-type]


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of `model` (unsharded sizes of sharded parameters)."""
    trainable = total = 0
    for param in model.parameters():
        count = param.numel()
        total += count
        trainable += count if param.requires_grad else 0
    return trainable, total


class AdaptersDisabled(nn.Module):
    """The policy with its adapters switched off: the frozen base model, as the KL reference.

    It holds no weights of its own (the policy is kept out of `parameters()`), so a checkpoint or an
    optimizer never sees it."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self._policy = [policy]  # a list: not registered as a submodule

    @property
    def config(self) -> Any:
        return self._policy[0].config

    def forward(self, **inputs: Any) -> Any:
        layers = adapter_layers(self._policy[0])
        for layer in layers:
            layer._disable_adapters = True
        try:
            return self._policy[0](**inputs)
        finally:
            for layer in layers:
                layer._disable_adapters = False


def adapter_layers(model: nn.Module) -> list[Any]:
    """PEFT's adapted layers of `model`.

    `AdaptersDisabled` sets their `_disable_adapters` flag (what their forward reads) instead of calling
    PEFT's `disable_adapter()`: that also switches `requires_grad` off and on on the parameters registered
    at the time, and FSDP2 swaps sharded and unsharded parameters between forwards, so the adapters'
    sharded parameters would stay frozen (the optimizer step then saw no trainable parameter)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def merged_state_dict(state: Mapping[str, Tensor], lora: LoraSpec) -> dict[str, Tensor]:
    """The plain model's state dict from a PEFT LoRA model's full one: adapters merged into their layers'
    weights (W + (alpha / r) B A, computed in float32 and cast back to W's dtype), PEFT's prefixes and
    infixes removed, the adapters themselves dropped. An empty `state` (ranks other than 0) stays empty."""
    scale = lora.alpha / lora.rank
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(PEFT_PREFIX)
        if BASE_LAYER in key:
            name = name.replace(BASE_LAYER, "")
            if key.endswith(".weight"):
                value = _merge(state, key, value, scale)
        out[name] = value
    return out


def adapter_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapters alone from a PEFT LoRA model's full state dict, named as PEFT saves an adapter
    (`base_model.model.<layer>.lora_A.weight`: the adapter's name dropped), which vLLM and
    `PeftModel.from_pretrained` load. An empty `state` (ranks other than 0) stays empty."""
    infix = f".{ADAPTER}."
    return {key.replace(infix, "."): value for key, value in state.items() if ".lora_" in key}


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The adapter's `adapter_config.json` content, from the PEFT model (sets as sorted lists)."""
    config = model.peft_config[ADAPTER].to_dict()  # type: ignore[index, operator, union-attr]
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def _merge(state: Mapping[str, Tensor], key: str, weight: Tensor, scale: float) -> Tensor:
    """W + scale * B @ A for the adapted weight at `key` (`...<layer>.base_layer.weight`)."""
    layer = key[: -len(f"{BASE_LAYER}.weight")]
    a = state[f"{layer}.lora_A.{ADAPTER}.weight"]  # (r, in)
    b = state[f"{layer}.lora_B.{ADAPTER}.weight"]  # (out, r)
    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale  # (out, in)
    return (weight.to(torch.float32) + delta).to(weight.dtype)
