"""KL divergence to the frozen reference policy: per-token estimators and the coefficient controllers.

Tokens are sampled from the policy p, so KL(p || p_ref) is estimated per token from the two log-probs
of the sampled token (Schulman, "Approximating KL divergence", 2020). With `log_r = ref_logp - logp`
(r = p_ref / p):
- k1 = -log_r: unbiased, high variance, can be negative per token.
- k2 = 0.5 * log_r**2: biased, low variance, >= 0; its gradient is that of the true KL's.
- k3 = r - 1 - log_r: unbiased and >= 0 (since e^x >= 1 + x); GRPO's choice.
`log_r` is clamped to +-LOG_RATIO_CLAMP (the bound of verl and OpenRLHF) in value only. Two ends need it:
- `log_r` very positive: a sampled token the *policy* finds near-impossible but the reference does not.
  k3's `exp(log_r)` overflows float32/bfloat16 past ~88.7 (inf, then NaN gradients); the clamp keeps it
  at most e^20 ~ 4.9e8.
- `log_r = -inf`: the reference gives the token zero probability (underflow in bfloat16, a masked
  vocabulary). Every estimator would be +inf; clamped, the token costs a finite penalty.
  (A token the reference merely finds unlikely is harmless: `exp` of a very negative number is 0.)
The clamp is straight-through: beyond it the gradient is the one at the bound (at most e^20 - 1 for
k3), not 0. verl and
OpenRLHF clamp with a plain `torch.clamp`, which zeroes the gradient there, so the KL term stops pulling
back exactly the tokens that drifted furthest from the reference (`log_r < -20`, where k1's and k3's true
gradients are ~1, perfectly tame). Values are identical to theirs (without verl's extra clamp of k3 to
10, which zeroes its gradient already at `log_r < -11`).

The coefficient is either fixed or adapted towards a target KL (Ziegler et al. 2019); the KL either
enters the loss (aggregated like the policy loss) or the reward (`apply_kl_penalty`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0


class _StraightThroughClamp(torch.autograd.Function):
    """`x.clamp(-bound, bound)` forward; the gradient passes unchanged backward (also for infinite x)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bound: float) -> Tensor:
        return x.clamp(-bound, bound)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """`log(p_ref / p)` per token, clamped straight-through to +-LOG_RATIO_CLAMP. (B, T) → (B, T)."""
    clamped: Tensor = _StraightThroughClamp.apply(ref_logp - logp, LOG_RATIO_CLAMP)
    return clamped


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log(p / p_ref) = logp - ref_logp. (B, T) → (B, T)."""
    return -_log_ratio(logp, ref_logp)


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 * (log(p_ref / p))**2. (B, T) → (B, T)."""
    return 0.5 * _log_ratio(logp, ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = r - 1 - log r with r = exp(ref_logp - logp); >= 0, 0 when p == p_ref. (B, T) → (B, T)."""
    log_r = _log_ratio(logp, ref_logp)
    return torch.expm1(log_r) - log_r


KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""Per-token KL estimators by name (`KLSpec.estimator`): (logp, ref_logp), both (B, T) → (B, T)."""


def apply_kl_penalty(token_rewards: Tensor, kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """KL in the reward: `r_t - coef * kl_t` on masked-in tokens, `r_t` elsewhere. All (B, T) → (B, T).

    `kl` should carry no gradient (rewards are constants of the policy-gradient loss); it is detached.
    """
    return token_rewards - coef * kl.detach() * mask.to(kl.dtype)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_samples: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the coefficient so the observed KL tracks `target`.

    After each step, `coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_samples / horizon`: above the
    target the coefficient grows, below it shrinks, by at most 20% per `horizon` samples.
    """

    def __init__(self, coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError("target and horizon must be positive")
        self.value = coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        """Adapt after a step that saw mean KL `current_kl` over `n_samples` samples."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon


def make_kl_controller(
    coef: float, target: float | None = None, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """The controller `KLSpec` describes: adaptive when a target is given, else fixed."""
    if target is None:
        return FixedKLController(coef)
    return AdaptiveKLController(coef, target, horizon)
