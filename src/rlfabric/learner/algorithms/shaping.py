"""Length shaping from DAPO: a soft penalty for running long, and masking completions cut at the limit.

A completion cut at `max_tokens` has no answer, so its reward says nothing about its reasoning; DAPO
either masks it out of the loss or penalises length smoothly in a buffer before the limit, so the
policy learns to stop before being cut rather than receiving one noisy cliff.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer_tokens: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward. `lengths` (B,) → (B,) float in [-1, 0].

    With `L_safe = max_tokens - buffer_tokens`: 0 for `L <= L_safe`, `(L_safe - L) / buffer_tokens` in the
    buffer (linear from 0 down to -1 at `max_tokens`), -1 at or beyond `max_tokens`.
    """
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError("need 0 < buffer_tokens <= max_tokens")
    safe = max_tokens - buffer_tokens
    return ((safe - lengths.to(torch.float32)) / buffer_tokens).clamp(-1.0, 0.0)


def is_truncated(lengths: Tensor, max_tokens: int) -> Tensor:
    """Completions that hit the length limit (prefer the engine's finish reason when it is known). (B,)."""
    return lengths >= max_tokens


def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """Drop truncated completions from the loss: `mask` (B, T), `truncated` (B,) bool → (B, T)."""
    return mask * (~truncated).unsqueeze(-1).to(mask.dtype)
