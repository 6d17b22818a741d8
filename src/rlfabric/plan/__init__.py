"""Memory planning: will a run fit, and where? Per role and per device, from config.json and the run spec.

`arch.ModelArch` reads a model's shape from its config.json (no weights); `memory` turns a run's shape into
per-role lines (weights, gradients, optimizer states, activations, logits buffers, communication buckets,
KV cache, framework overhead), each with its formula. Neither imports torch.
"""

from rlfabric.plan.arch import ModelArch, UnsupportedModel
from rlfabric.plan.memory import (
    DEFAULT_PROMPT_TOKENS,
    LINE_NAMES,
    LearnerShape,
    Line,
    RoleMemory,
    kv_cache_needed,
    learner_memory,
    learner_shape,
    rank_total,
    reward_model_memory,
    rollout_memory,
)

__all__ = [
    "DEFAULT_PROMPT_TOKENS",
    "LINE_NAMES",
    "LearnerShape",
    "Line",
    "ModelArch",
    "RoleMemory",
    "UnsupportedModel",
    "kv_cache_needed",
    "learner_memory",
    "learner_shape",
    "rank_total",
    "reward_model_memory",
    "rollout_memory",
]
