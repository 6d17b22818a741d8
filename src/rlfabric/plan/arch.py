"""A decoder-only language model's shape, read from its Hugging Face `config.json` alone (no weights).

Users plan a 7B or 72B run before downloading it, so everything here comes from the config's numbers,
and the module never imports torch or transformers (planning answers in well under a second).

`ModelArch.params()` is the exact parameter count of the Llama-family decoders transformers builds:
Llama, Qwen2 (biases on q/k/v), Qwen3 (RMSNorm on q and k per head), Mistral, and the sparse
mixture-of-experts variants Mixtral and Qwen3-MoE (a router and `num_experts` gated MLPs per layer). Other
shapes raise `UnsupportedModel` naming what is not modelled rather than returning a wrong count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each floating dtype a model or run may name."""

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe")
"""`model_type`s whose parameter count `ModelArch.params` knows exactly."""

QKV_BIAS_TYPES = ("qwen2",)
"""Model types with biases on the q, k and v projections (and none on o) whatever the config says."""
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
"""Model types with an RMSNorm of width head_dim on the queries and on the keys of every layer."""

KV_HEADS_DEFAULT = {"mistral": 8, "mixtral": 8}
"""`num_key_value_heads` of a config that omits it where transformers does not default it to the heads."""


class UnsupportedModel(ValueError):
    """The config describes a shape the planner does not model (the message names the field)."""


@dataclass(frozen=True)
class ModelArch:
    """The numbers of a decoder-only causal LM that decide its memory."""

    model_type: str
    """The config's `model_type` (one of `SUPPORTED_TYPES`)."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Key/value heads (grouped-query attention); the config's, else `num_attention_heads`."""
    head_dim: int
    """The config's `head_dim`, else `hidden_size // num_attention_heads`."""
    intermediate_size: int
    """Width of the dense gated MLP (of each expert when `num_experts` and no `moe_intermediate_size`)."""
    vocab_size: int
    tie_word_embeddings: bool = False
    """The LM head shares the input embedding matrix (counted once)."""
    max_position_embeddings: int = 2048
    torch_dtype: str = "float32"
    """The dtype the checkpoint is stored in (`dtype` or `torch_dtype` of the config)."""
    attention_bias: bool = False
    """Biases on q, k, v and o (Llama's `attention_bias`); Qwen2 has q/k/v biases regardless."""
    mlp_bias: bool = False
    """Biases on the MLP's three projections (Llama's `mlp_bias`)."""
    num_experts: int = 0
    """Routed experts per layer (`num_experts` / `num_local_experts`); 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (compute and activations, not parameters)."""
    moe_intermediate_size: int = 0
    """Width of each expert's MLP; 0 means `intermediate_size`."""

    @property
    def q_width(self) -> int:
        """Output width of the query projection: heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Output width of the key (and of the value) projection: kv heads x head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def expert_width(self) -> int:
        """MLP width of one expert."""
        return self.moe_intermediate_size or self.intermediate_size

    def attention_params(self) -> int:
        """q, k, v, o projections of one layer, their biases and any q/k norms."""
        h, q, kv = self.hidden_size, self.q_width, self.kv_width
        weights = h * q + 2 * h * kv + q * h
        if self.model_type in QKV_BIAS_TYPES:
            biases = q + 2 * kv
        elif self.attention_bias:
            biases = q + 2 * kv + h
        else:
            biases = 0
        norms = 2 * self.head_dim if self.model_type in QK_NORM_TYPES else 0
        return weights + biases + norms

    def mlp_params(self) -> int:
        """The gated MLP of one layer (gate, up, down), or its router and every expert's."""
        h = self.hidden_size
        if self.num_experts:
            return h * self.num_experts + self.num_experts * 3 * h * self.expert_width
        i = self.intermediate_size
        return 3 * h * i + (2 * i + h if self.mlp_bias else 0)

    def layer_params(self) -> int:
        """One decoder layer: attention, MLP and its two RMSNorms."""
        return self.attention_params() + self.mlp_params() + 2 * self.hidden_size

    def embedding_params(self) -> int:
        """The input embedding matrix."""
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """The output projection; 0 when tied to the embeddings."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def params(self) -> int:
        """Every parameter of the causal LM (tied embeddings counted once)."""
        body = self.num_hidden_layers * self.layer_params() + self.hidden_size  # + the final norm
        return self.embedding_params() + body + self.lm_head_params()

    def backbone_params(self) -> int:
        """The model without its LM head (what a critic or reward model keeps under its scalar head)."""
        return self.params() - self.lm_head_params()

    @property
    def dtype_bytes(self) -> int:
        """Bytes per stored parameter."""
        return DTYPE_BYTES[self.torch_dtype]

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any]) -> ModelArch:
        """From a config.json: a path to the file, to a model folder holding one, or the parsed dict."""
        config = source if isinstance(source, dict) else read_config(Path(source))
        return from_dict(config)


def read_config(path: Path) -> dict[str, Any]:
    """The parsed config.json at `path` (the file, or a folder holding it)."""
    file = path / "config.json" if path.is_dir() else path
    data = json.loads(file.read_text())
    if not isinstance(data, dict):
        raise UnsupportedModel(f"{file}: not a JSON object")
    return data


def _required(config: dict[str, Any], name: str) -> int:
    """An integer field the planner cannot do without."""
    if config.get(name) is None:
        raise UnsupportedModel(f"config.json has no {name!r} (model_type {config.get('model_type')!r})")
    return int(config[name])


def _model_type(config: dict[str, Any]) -> str:
    """The config's `model_type`, refused when its parameter count is not modelled."""
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not modelled (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModel("shared_expert_intermediate_size: shared experts are not modelled")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModel("mlp_only_layers / decoder_sparse_step: mixed dense and sparse layers")
    return model_type


def _dtype(config: dict[str, Any]) -> str:
    """The checkpoint's dtype (`dtype`, older configs' `torch_dtype`), float32 when absent."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if name not in DTYPE_BYTES:
        raise UnsupportedModel(f"dtype {name!r} is not one of {', '.join(DTYPE_BYTES)}")
    return name


def from_dict(config: dict[str, Any]) -> ModelArch:
    """`ModelArch` from a parsed config.json (see `ModelArch.from_config`)."""
    model_type = _model_type(config)
    hidden, heads = _required(config, "hidden_size"), _required(config, "num_attention_heads")
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    return ModelArch(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=_required(config, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or KV_HEADS_DEFAULT.get(model_type, heads)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=_required(config, "intermediate_size"),
        vocab_size=_required(config, "vocab_size"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        torch_dtype=_dtype(config),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        num_experts=experts,
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0) if experts else 0,
    )
