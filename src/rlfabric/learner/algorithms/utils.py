"""Masked reductions shared by every algorithm.

Response tensors are right-padded `(B, T)` with a mask that is 1 (or True) on the tokens that count.
Every reduction here ignores the masked-out positions and returns 0, never NaN, when nothing counts:
fully masked rows are normal (a truncated completion masked out of the loss, an empty response).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _safe_count(count: Tensor) -> Tensor:
    """The count itself where positive, else 1: the matching sum is then 0 and so is the mean.

    Substituting the denominator (rather than `torch.where` over a quotient) keeps gradients finite.
    """
    return torch.where(count > 0, count, torch.ones_like(count))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is set, over `dim` (all dims when None). `x`, `mask`: same shape."""
    masked = x * mask.to(x.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is set; 0 where no position is set."""
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / _safe_count(count)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of `x` (all dims), Bessel-corrected when `unbiased`; 0 if < 2."""
    mean = masked_mean(x, mask)
    sq_sum = masked_sum((x - mean) ** 2, mask)
    count = masked_sum(torch.ones_like(x), mask)
    denom = count - 1 if unbiased else count
    return sq_sum / _safe_count(denom)


def masked_is_constant(x: Tensor, mask: Tensor) -> Tensor:
    """Whether every masked-in entry of `x` is equal (true for one entry; false for none): a 0-dim bool.

    Compared exactly (max == min), not through the variance: float rounding makes the mean of equal
    float32 values differ from them (30 copies of 0.9 average to 0.9 - 1.8e-7).
    """
    valid = mask.bool()
    highest = x.masked_fill(~valid, float("-inf")).amax()
    lowest = x.masked_fill(~valid, float("inf")).amin()
    return highest == lowest


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6, shift_mean: bool = True) -> Tensor:
    """`(x - mean) / (std + eps)` over the masked entries (unbiased std); masked positions become 0.

    Invariants:
    1. All masked-in entries equal (or only one): exactly 0 on them, for any `eps` (with
       `shift_mean=False`, exactly the mean). The rounding error of the mean is not divided by a std
       of the same order: 30 float32 copies of 0.9 would otherwise whiten to -0.151 each.
    2. A zero std never gives NaN, even with `eps=0`.
    3. With `shift_mean=False` the mean is added back (scale only), as some value normalisations want.
    """
    mean = masked_mean(x, mask)
    denom = masked_var(x, mask).sqrt() + eps
    whitened = (x - mean) / torch.where(denom > 0, denom, 1.0)
    whitened = torch.where(masked_is_constant(x, mask), torch.zeros_like(whitened), whitened)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)
