"""Offline preference losses: DPO, IPO, SimPO and ORPO on (chosen, rejected) pairs, KTO on unpaired rows.

Inputs are completion log-probs, (B,): one entry per pair (per row for KTO), `log pi(y|x)` summed over
the completion's tokens or averaged over them, as `LOSS_KINDS[name].average` says (the trainer computes
them so). Every loss returns its mean over the batch and detached statistics.

With references, on the implicit reward margin
    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)):
- DPO (Rafailov et al. 2023), summed log-probs: `-log sigmoid(beta h)`; with label smoothing eps
  (conservative DPO, the labels flipped with probability eps):
  `-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`.
- IPO (Azar et al. 2023), per-token mean log-probs (the IPO paper's choice, and TRL's):
  `(h - 1 / (2 beta))^2`, a squared loss that stops pushing once the margin is reached, so it cannot
  drive the policy to deterministic preferences.
Without a reference (the trainer then loads none: one model in memory):
- SimPO (Meng et al. 2024, eq. 6), per-token mean log-probs `m(y) = log pi(y|x) / |y|`:
  `-log sigmoid(beta m(y_w) - beta m(y_l) - gamma)`; gamma is the paper's target reward margin in reward
  units (TRL's `simpo_gamma`, not the SimPO repository's `gamma_beta_ratio` = gamma / beta). Label
  smoothing as DPO's (TRL's CPO trainer does the same).
- ORPO (Hong et al. 2024, eqs. 4-7), per-token mean log-probs m(y), P(y|x) = exp(m(y)):
  `-m(y_w) + lambda * -log sigmoid(log odds(y_w) - log odds(y_l))`, odds(y) = P / (1 - P), so
  log odds(y) = m(y) - log(1 - exp(m(y))) (`log1mexp`, stable). The first term is the paper's L_SFT, the
  chosen completion's negative log-likelihood averaged over its tokens (then over pairs; TRL instead
  averages over every chosen token of its batch).
Unpaired:
- KTO (Ethayarajh et al. 2024, eq. 7 with TRL's loss), summed log-probs, r = log pi(y|x) - log pi_ref(y|x):
  desirable rows `lambda_D (1 - sigmoid(beta (r - z0)))`, undesirable rows
  `lambda_U (1 - sigmoid(beta (z0 - r)))`, mean over rows. z0 is the reference point, a detached
  estimate of KL(pi || pi_ref), given by the caller (the trainer's: max(0, mean over the step's
  mismatched (prompt, completion) rows of log pi(y'|x) - log pi_ref(y'|x)), the paper's estimator).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

PAIR_STATS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")
"""Every pair loss's statistics, batch means: the implicit rewards, their margin and the share of pairs
whose chosen reward is strictly above the rejected one."""
ORPO_STATS = (*PAIR_STATS, "nll_loss", "odds_ratio_loss")
"""ORPO's: its rewards are the log odds; plus its two terms (the odds-ratio term unweighted)."""
KTO_STATS = ("rewards_chosen_sum", "rewards_rejected_sum", "desirable", "undesirable")
"""KTO's: sums over the batch's desirable and undesirable rows of the rewards `beta r`, and the two counts
(sums, not means: a batch may hold no row of a class, and the caller divides over a whole step)."""

MAX_MEAN_LOGP = -1e-6
"""ORPO clamps a per-token mean log-prob to at most this (P <= 0.999999): at 0 (every token certain in
float32) the odds are infinite. A clamped completion's odds term has no gradient; its NLL term keeps one."""


@dataclass(frozen=True)
class LossKind:
    """What a preference loss needs from its trainer."""

    reference: bool
    """It reads the frozen reference's log-probs (the trainer loads a reference only then)."""
    average: bool
    """Completion log-probs are per-token means (else sums over the completion's tokens)."""
    paired: bool
    """It trains on (chosen, rejected) pairs; False: on unpaired rows labelled desirable or not (KTO)."""
    stats: tuple[str, ...]
    """The names of the statistics it returns."""


LOSS_KINDS: dict[str, LossKind] = {
    "dpo": LossKind(reference=True, average=False, paired=True, stats=PAIR_STATS),
    "ipo": LossKind(reference=True, average=True, paired=True, stats=PAIR_STATS),
    "simpo": LossKind(reference=False, average=True, paired=True, stats=PAIR_STATS),
    "orpo": LossKind(reference=False, average=True, paired=True, stats=ORPO_STATS),
    "kto": LossKind(reference=True, average=False, paired=False, stats=KTO_STATS),
}
"""Each loss of `PREFERENCE_LOSSES` by name: its inputs and statistics."""


def reward_stats(chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """`PAIR_STATS` of per-pair rewards (B,): batch means, detached."""
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "rewards_chosen": chosen.mean(),
        "rewards_rejected": rejected.mean(),
        "reward_margin": (chosen - rejected).mean(),
        "reward_accuracy": (chosen > rejected).to(chosen.dtype).mean(),
    }


def preference_stats(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> dict[str, Tensor]:
    """Implicit rewards `beta * (log pi - log pi_ref)`, their margin and accuracy, batch means (detached)."""
    return reward_stats(beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected))


def _margin(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor
) -> Tensor:
    """`h` of the module docstring. (B,) → (B,)."""
    return (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)


def _smoothed_logistic(logits: Tensor, label_smoothing: float) -> Tensor:
    """`-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)` per entry: (B,) → (B,)."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sigmoid DPO, optionally label-smoothed; mean over pairs. Inputs (B,) → loss () and stats."""
    logits = beta * _margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = _smoothed_logistic(logits, label_smoothing)
    stats = preference_stats(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    return losses.mean(), stats


def ipo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IPO: `(h - 1/(2 beta))^2`, mean over pairs. Inputs (B,) → loss () and stats."""
    margin = _margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = (margin - 1 / (2 * beta)) ** 2
    stats = preference_stats(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    return losses.mean(), stats


def simpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO on per-token mean log-probs (B,): `-log sigmoid(beta (m_w - m_l) - gamma)`, label-smoothed as
    DPO, mean over pairs. Its rewards are `beta * m` (length-normalised, reference-free)."""
    chosen, rejected = beta * policy_chosen, beta * policy_rejected
    losses = _smoothed_logistic(chosen - rejected - gamma, label_smoothing)
    return losses.mean(), reward_stats(chosen, rejected)


def log1mexp(x: Tensor) -> Tensor:
    """`log(1 - exp(x))` for x < 0, without cancellation: `log(-expm1(x))` near 0, `log1p(-exp(x))` below
    -log 2 (Mächler 2012). Both branches are finite for x < 0, so the gradient is too."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def log_odds(mean_logps: Tensor) -> Tensor:
    """ORPO's `log(P / (1 - P))` with `log P` = per-token mean log-prob, clamped to `MAX_MEAN_LOGP`."""
    clamped = mean_logps.clamp(max=MAX_MEAN_LOGP)
    return clamped - log1mexp(clamped)


def orpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, *, lam: float = 0.1
) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO on per-token mean log-probs (B,): `-m_w + lam * -log sigmoid(log odds_w - log odds_l)`, mean
    over pairs. Its rewards are the log odds; `nll_loss` and `odds_ratio_loss` are the two terms."""
    chosen, rejected = log_odds(policy_chosen), log_odds(policy_rejected)
    odds_ratio = -F.logsigmoid(chosen - rejected)
    nll = -policy_chosen
    stats = reward_stats(chosen, rejected)
    stats.update(nll_loss=nll.detach().mean(), odds_ratio_loss=odds_ratio.detach().mean())
    return (nll + lam * odds_ratio).mean(), stats


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    *,
    kl: Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO on summed log-probs of unpaired rows (B,), `desirable` (B,) bool, `kl` the reference point z0
    (>= 0, treated as a constant: detached here): mean over rows of each row's weighted loss. Stats are
    `KTO_STATS` (sums and counts)."""
    z0 = torch.as_tensor(kl, dtype=policy_logps.dtype, device=policy_logps.device).detach()
    r = policy_logps - ref_logps
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    losses = torch.where(desirable, chosen, rejected)
    rewards = (beta * r).detach()
    stats = {
        "rewards_chosen_sum": rewards[desirable].sum(),
        "rewards_rejected_sum": rewards[~desirable].sum(),
        "desirable": desirable.to(rewards.dtype).sum(),
        "undesirable": (~desirable).to(rewards.dtype).sum(),
    }
    return losses.mean(), stats


LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""A preference loss: log-prob tensors (and options as keywords) → (mean loss, statistics)."""

PREFERENCE_LOSSES: dict[str, LossFn] = {
    "dpo": dpo_loss,
    "ipo": ipo_loss,
    "simpo": simpo_loss,
    "orpo": orpo_loss,
    "kto": kto_loss,
}
"""Offline preference losses by name (`LOSS_KINDS` says what each reads). The reference-based pair losses
take (policy_chosen, policy_rejected, ref_chosen, ref_rejected), the reference-free ones
(policy_chosen, policy_rejected), KTO (policy_logps, ref_logps, desirable); options are keywords."""
