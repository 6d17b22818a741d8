"""Loss aggregation: how a per-token loss `(B, T)` becomes the scalar that is differentiated.

The choice decides how much each token weighs, and so what a long response costs:
- `token_mean`: every valid token of the batch weighs the same (DAPO).
- `seq_mean_token_mean`: every response weighs the same, its tokens share its weight (GRPO as written);
  long responses get a smaller per-token gradient, which Dr.GRPO shows biases towards long wrong answers.
- `seq_mean_token_sum`: every response weighs the same and each token counts fully.
- `constant`: Dr.GRPO's unbiased normaliser, `sum / (B * max_tokens)`: fixed, independent of lengths.
Sequence means are over rows with at least one valid token (a fully masked row is not a response to
average in); `constant` counts all B rows because its normaliser must not depend on the batch content.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from rlfabric.learner.algorithms.utils import masked_mean, masked_sum


class Aggregation(Protocol):
    """`loss`, `mask`: (B, T) → scalar. `max_tokens` is the `constant` mode's normaliser."""

    def __call__(self, loss: Tensor, mask: Tensor, *, max_tokens: int | None = None) -> Tensor: ...


def token_mean(loss: Tensor, mask: Tensor, *, max_tokens: int | None = None) -> Tensor:
    """Sum over valid tokens / number of valid tokens. (B, T) → ()."""
    return masked_mean(loss, mask)


def _seq_mean(per_seq: Tensor, mask: Tensor) -> Tensor:
    """Mean of `per_seq` (B,) over the rows of `mask` (B, T) that have a valid token."""
    has_tokens = mask.sum(dim=-1) > 0
    return masked_mean(per_seq, has_tokens)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, *, max_tokens: int | None = None) -> Tensor:
    """Mean over responses of each response's token mean. (B, T) → ()."""
    return _seq_mean(masked_mean(loss, mask, dim=-1), mask)


def seq_mean_token_sum(loss: Tensor, mask: Tensor, *, max_tokens: int | None = None) -> Tensor:
    """Mean over responses of each response's token sum. (B, T) → ()."""
    return _seq_mean(masked_sum(loss, mask, dim=-1), mask)


def constant(loss: Tensor, mask: Tensor, *, max_tokens: int | None = None) -> Tensor:
    """Dr.GRPO: sum over valid tokens / (B * max_tokens). (B, T) → ()."""
    if max_tokens is None or max_tokens <= 0:
        raise ValueError("the constant aggregation needs max_tokens > 0")
    return masked_sum(loss, mask) / (loss.shape[0] * max_tokens)


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "constant": constant,
}
"""Loss aggregations by name (`AlgorithmSpec.loss_aggregation`)."""


def aggregate(loss: Tensor, mask: Tensor, mode: str, max_tokens: int | None = None) -> Tensor:
    """Reduce `loss` (B, T) with the aggregation named `mode`."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](loss, mask, max_tokens=max_tokens)
