"""`[model]`: the policy, its reference and critic, a tiny model to build, LoRA adapters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlfabric.runspec.base import (
    MAX_TOKENS,
    SpecModel,
)


class TinyModelRecipe(SpecModel):
    """A random tiny model `rlfabric up` builds at `model.path` when nothing is there yet
    (`rlfabric make-tiny-model`'s options): examples and demos that must run without downloading."""

    preset: Literal["tiny", "bench"] = "tiny"
    """Shape: tiny (0.4 M parameters) or bench (24 M)."""
    tokenizer: Literal["char", "bpe"] = "bpe"
    """char: one token per character (ChatML); bpe: a byte-level BPE with a Qwen2.5-style tool template."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Seed of the random weights."""


class LoraSpec(SpecModel):
    """Low-rank adapters (LoRA, through PEFT) trained instead of the policy's full weights."""

    rank: int = Field(default=16, ge=1, le=1024)
    """The adapters' rank r."""
    alpha: int = Field(default=32, ge=1, le=1 << 16)
    """Scale numerator: an adapter adds (alpha / r) * B @ A to its layer's weight."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training."""
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names (last component) of the linear layers that get an adapter; the default is every attention and
    MLP projection of Llama/Qwen/Mistral-style models. `["all-linear"]` is PEFT's every linear layer but
    the head."""
    publish: Literal["adapter", "merged"] = "adapter"
    """What each published version holds: the adapter alone (a few MB; replicas serve it beside the base
    model and need `engine.max_adapters` >= 1, which `rlfabric up` sets), or the policy with the adapter
    merged into its weights (any replica, full-weight transfers). Broadcast transport: merged only."""


class ModelSpec(SpecModel):
    """The policy and its frozen reference."""

    path: str
    """Local folder or hub id of the policy, loaded with transformers / vLLM (weights never downloaded by
    tests: they build tiny models with `rlfabric make-tiny-model`)."""
    reference_path: str | None = None
    """Reference model for the KL penalty; defaults to `path`. Online runs do not load it when the KL
    coefficient is 0; offline preference runs load it for dpo, ipo and kto (orpo and simpo need none)."""
    critic_path: str | None = None
    """Causal LM whose transformer backbone (LM head dropped, a fresh scalar value head added) is the PPO
    critic; defaults to `path`. Loaded only with the gae estimator."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype: auto is bfloat16 where the device computes it natively (a GPU with bfloat16, a CPU
    with AMX, or with AVX-512 BF16 where a probe measures bfloat16 faster) and float32 elsewhere
    (`rlfabric.runtime.hardware`); bfloat16 where it is not native warns."""
    max_model_len: int = Field(default=2048, ge=16, le=MAX_TOKENS)
    """Longest prompt + completion in tokens."""
    tiny: TinyModelRecipe | None = None
    """Build a random tiny model at `path` when the folder does not exist yet (`rlfabric up` only; a run
    submitted to the services needs the folder)."""
    lora: LoraSpec | None = None
    """Train LoRA adapters on the frozen policy instead of its weights (online runs). The KL reference is
    then the same model with its adapters disabled (no second copy) unless `reference_path` names another;
    what each published version holds is `lora.publish`'s choice."""

    @property
    def published_adapter(self) -> LoraSpec | None:
        """The LoRA spec when each published version is the adapter alone (replicas serve it beside the
        base model); None for full-weight versions (no LoRA, or `publish = "merged"`)."""
        return self.lora if self.lora is not None and self.lora.publish == "adapter" else None
