"""Token entropy of the policy and the entropy bonus that keeps exploration from collapsing."""

from __future__ import annotations

import torch
from torch import Tensor

from rlfabric.learner.algorithms.aggregation import aggregate


def entropy_from_logits(logits: Tensor) -> Tensor:
    """`H = -sum_v p_v log p_v` per position, via `log_softmax` (logsumexp). (B, T, V) → (B, T).

    Logits of -inf (a masked vocabulary) contribute 0: their log-prob is clamped to the dtype's minimum so
    that `0 * log 0` is 0, not NaN, in value and in gradient.
    """
    log_probs = torch.log_softmax(logits, dim=-1).clamp(min=torch.finfo(logits.dtype).min)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def entropy_bonus(
    entropy: Tensor, mask: Tensor, coef: float, aggregation: str = "token_mean", max_tokens: int | None = None
) -> Tensor:
    """The loss term `-coef * aggregate(entropy)`: adding it rewards higher entropy. (B, T) → ()."""
    return -coef * aggregate(entropy, mask, aggregation, max_tokens)
