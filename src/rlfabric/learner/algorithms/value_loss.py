"""PPO's clipped value (critic) loss.

The critic's new prediction may move at most `clip_eps` from the value it had when the batch was
collected; the loss takes the worse (larger) of the clipped and unclipped squared errors, so the clip only
ever removes the incentive to move further (PPO2 / OpenAI baselines).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfabric.learner.algorithms.aggregation import aggregate
from rlfabric.learner.algorithms.utils import masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
    aggregation: str = "token_mean",
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`0.5 * max((V - R)^2, (V_clip - R)^2)` with `V_clip = V_old + clip(V - V_old, -eps, eps)`.

    `values` (B, T) with gradient, `old_values`, `returns`, `mask` (B, T). `clip_eps=None` is the plain
    `0.5 * (V - R)^2`. Returns the aggregated loss and detached stats: value_clip_fraction, value_mean.
    """
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    per_token, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    if clip_eps is not None:
        old_values = old_values.detach()
        clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped_error = (clipped_values - returns) ** 2
        per_token = torch.maximum(unclipped, clipped_error)
        clipped = clipped_error > unclipped
    loss = 0.5 * aggregate(per_token, mask, aggregation, max_tokens)
    stats = {
        "value_clip_fraction": masked_mean(clipped.to(values.dtype), mask).detach(),
        "value_mean": masked_mean(values, mask).detach(),
    }
    return loss, stats
