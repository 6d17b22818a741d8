"""The clipped policy-gradient loss of PPO and its descendants (GRPO, DAPO, Dr.GRPO, GSPO).

Per token, with importance ratio `rho = pi(y_t) / pi_old(y_t)` and advantage `A`:
    loss = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))
- clip-higher (DAPO): `eps_high > eps_low` leaves more room to raise unlikely tokens' probability.
- dual clip (Ye et al. 2020): for `A < 0` the loss is also capped at `-A * c`, so a huge ratio on a bad
  token cannot produce an unbounded update.
- GSPO (Zheng et al. 2025): `rho` is the sequence's geometric-mean ratio
  `exp(mean_t log(pi / pi_old))`, clipped as a whole. It is written in the GSPO-token form
  `sg[s] * pi / sg[pi]`, equal in value to `s` and, with advantages constant along a response and the
  `seq_mean_token_mean` aggregation, equal in gradient to the sequence-level objective.
- TIS (truncated importance sampling): the samples came from the inference engine, whose log-probs
  (`rollout_logp`) differ from the trainer's `old_logp` (kernels, precision, off-policy lag). Each token's
  loss is weighted by `min(exp(old_logp - rollout_logp), cap)`, a constant of the gradient.
The per-token loss is then reduced by one of `AGGREGATIONS`.

The log-ratio `log(pi / pi_old)` is clamped to +-LOG_RATIO_CLAMP (20, as verl) before `exp`, a plain
clamp: the ratio stays within [2e-9, 4.9e8], so `-A * rho`, its gradient and the ratio statistics stay
finite (float32 `exp` overflows past 88.7, and one inf in a sum makes the whole step NaN). A token beyond
the clamp gets no gradient. Below it that loses nothing: the gradient there is at most `2e-9 * |A|`
(or 0, clipped). Above it a positive-advantage token is clipped anyway; a negative-advantage one loses a
gradient of at least `4.9e8 * |A|`, which would swamp every other token of the step, so zeroing it acts
as a last-resort dual clip (the real one, `dual_clip`, bounds such tokens from ratio `c` on). The TIS
weight's log-ratio has the same upper clamp (a detached weight, capped at `tis_cap` anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlfabric.learner.algorithms.aggregation import aggregate
from rlfabric.learner.algorithms.utils import masked_mean

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """The knobs of `policy_loss`; mirrors the loss fields of the run spec's `AlgorithmSpec`."""

    clip_eps_low: float = 0.2
    """Ratios below 1 - clip_eps_low are clipped (for A < 0)."""
    clip_eps_high: float = 0.2
    """Ratios above 1 + clip_eps_high are clipped (for A > 0)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; None disables it."""
    gspo: bool = False
    """Use GSPO's sequence-level ratio."""
    tis_cap: float | None = None
    """Cap of the truncated importance weight; None disables TIS even if rollout log-probs are given."""
    aggregation: str = "token_mean"
    """A name in AGGREGATIONS."""
    max_tokens: int | None = None
    """The normaliser of the `constant` aggregation (the rollout's max_tokens)."""


def importance_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, gspo: bool = False) -> Tensor:
    """`log(pi / pi_old)` per token, or GSPO's sequence ratio in GSPO-token form, clamped to
    +-LOG_RATIO_CLAMP (zero gradient beyond: see the module docstring). All (B, T) → (B, T)."""
    log_ratio = logp - old_logp
    if gspo:
        seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).detach().unsqueeze(-1)
        log_ratio = logp - logp.detach() + seq_log_ratio
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_token_loss(
    ratio: Tensor, advantages: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip (with optional dual clip) per token. `ratio`, `advantages`: (B, T).

    Returns `(loss, clipped, dual_clipped)`, all (B, T); the last two are bool masks of the tokens whose
    loss came from a clipped (zero-gradient) branch.
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if config.dual_clip is not None:
        bound = -advantages * config.dual_clip
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return loss, clipped, dual_clipped


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """`min(exp(old_logp - rollout_logp), cap)`, detached, and where the cap bit. (B, T) → both (B, T)."""
    raw = (old_logp - rollout_logp).detach().clamp(max=LOG_RATIO_CLAMP).exp()
    return raw.clamp(max=cap), raw > cap


def _ratio_stats(log_ratio: Tensor, ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Ratio mean/max and `approx_kl` (k3 estimate of KL(pi_old || pi)) over the valid tokens."""
    valid = mask.bool()
    return {
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max(),
    }


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig,
    rollout_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped policy-gradient loss and its statistics.

    `logp` (B, T): the current policy's log-probs of the sampled tokens (with gradient); `old_logp`
    (B, T): the trainer's log-probs before this step's updates; `advantages`, `mask` (B, T);
    `rollout_logp` (B, T): the inference engine's log-probs, for TIS. Returns the scalar loss and
    detached scalar stats: clip_fraction, dual_clip_fraction, approx_kl, ratio_mean, ratio_max and, with
    TIS, tis_weight_mean and tis_capped_fraction.
    """
    log_ratio = importance_log_ratio(logp, old_logp.detach(), mask, config.gspo)
    ratio = log_ratio.exp()
    loss, clipped, dual_clipped = clipped_token_loss(ratio, advantages.detach(), config)
    stats = _ratio_stats(log_ratio, ratio, mask)
    stats["clip_fraction"] = masked_mean(clipped.to(loss.dtype), mask)
    stats["dual_clip_fraction"] = masked_mean(dual_clipped.to(loss.dtype), mask)
    if rollout_logp is not None and config.tis_cap is not None:
        weights, capped = tis_weights(old_logp, rollout_logp, config.tis_cap)
        loss = loss * weights
        stats["tis_weight_mean"] = masked_mean(weights, mask)
        stats["tis_capped_fraction"] = masked_mean(capped.to(loss.dtype), mask)
    total = aggregate(loss, mask, config.aggregation, config.max_tokens)
    return total, {name: value.detach() for name, value in stats.items()}
