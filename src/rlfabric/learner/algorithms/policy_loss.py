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
- Rollout correction: the samples came from the inference engine, whose log-probs (`rollout_logp`)
  differ from the trainer's `old_logp` (kernels, precision, policy lag in asynchronous runs). With
  `w = exp(old_logp - rollout_logp)` per token, each token's loss is weighted by a constant of the
  gradient (`ROLLOUT_CORRECTIONS`):
  - `truncate`, TIS (Yao et al. 2025): `min(w, cap)`;
  - `mask_token`, IcePop (Ling team 2025) / token-level MIS: `w` where `low <= w <= cap`, else 0: a token
    whose engine and trainer probabilities disagree by more than the bounds teaches nothing, instead
    of a capped but still biased push;
  - `mask_sequence`, sequence-level MIS (Liu et al. 2025): a sample whose geometric-mean weight
    `exp(mean_t log w)` leaves `[low, cap]` is dropped whole; the others are truncated as by TIS.
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
ROLLOUT_CORRECTIONS = ("truncate", "mask_token", "mask_sequence")


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
    """Upper bound of the rollout-correction weight; None disables the correction even if rollout
    log-probs are given."""
    rollout_correction: str = "truncate"
    """A name in ROLLOUT_CORRECTIONS."""
    mask_low: float = 0.5
    """Lower bound of the weight kept by the `mask_*` corrections."""
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


def rollout_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, Tensor]:
    """The rollout correction's per-token weights (detached) and where they were bounded: capped
    (`truncate`) or masked to 0 (`mask_*`). All (B, T); see the module docstring."""
    assert config.tis_cap is not None
    cap, low = config.tis_cap, config.mask_low
    if config.rollout_correction == "truncate":
        return tis_weights(old_logp, rollout_logp, cap)
    log_w = (old_logp - rollout_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    raw = log_w.exp()
    if config.rollout_correction == "mask_token":
        outside = (raw < low) | (raw > cap)
        return torch.where(outside, torch.zeros_like(raw), raw), outside
    if config.rollout_correction == "mask_sequence":
        seq = masked_mean(log_w, mask, dim=-1).exp().unsqueeze(-1)  # (B, 1)
        outside = ((seq < low) | (seq > cap)).expand_as(raw)
        return torch.where(outside, torch.zeros_like(raw), raw.clamp(max=cap)), outside
    raise ValueError(f"rollout_correction: {config.rollout_correction!r} is not one of {ROLLOUT_CORRECTIONS}")


def rollout_mismatch(logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's: `rollout_mismatch_kl`,
    the k3 estimate of KL(engine || trainer) per token (`w - 1 - log w` with `w = p_trainer / p_engine`,
    unbiased under the engine's samples), and `rollout_logprob_abs_diff`, the mean `|log w|`. Both are 0
    when the two agree. `logp`, `rollout_logp`, `mask`: (B, T); scalars out, detached."""
    log_w = (logp.detach() - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "rollout_mismatch_kl": masked_mean(torch.expm1(log_w) - log_w, mask),
        "rollout_logprob_abs_diff": masked_mean(log_w.abs(), mask),
    }


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
    `rollout_logp` (B, T): the inference engine's log-probs, for the rollout correction. Returns the
    scalar loss and detached scalar stats: clip_fraction, dual_clip_fraction, approx_kl, ratio_mean,
    ratio_max and, with the correction, tis_weight_mean and tis_capped_fraction (`truncate`: the share of
    tokens whose weight was capped) or rollout_masked_fraction (`mask_*`: the share of tokens dropped).
    """
    log_ratio = importance_log_ratio(logp, old_logp.detach(), mask, config.gspo)
    ratio = log_ratio.exp()
    loss, clipped, dual_clipped = clipped_token_loss(ratio, advantages.detach(), config)
    stats = _ratio_stats(log_ratio, ratio, mask)
    stats["clip_fraction"] = masked_mean(clipped.to(loss.dtype), mask)
    stats["dual_clip_fraction"] = masked_mean(dual_clipped.to(loss.dtype), mask)
    if rollout_logp is not None and config.tis_cap is not None:
        weights, bounded = rollout_weights(old_logp, rollout_logp, mask, config)
        loss = loss * weights
        stats["tis_weight_mean"] = masked_mean(weights, mask)
        truncated = config.rollout_correction == "truncate"
        stats["tis_capped_fraction" if truncated else "rollout_masked_fraction"] = masked_mean(
            bounded.to(loss.dtype), mask
        )
    total = aggregate(loss, mask, config.aggregation, config.max_tokens)
    return total, {name: value.detach() for name, value in stats.items()}
