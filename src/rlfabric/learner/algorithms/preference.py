"""Offline preference losses on (chosen, rejected) pairs: DPO and IPO.

Both act on the implicit reward margin
    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
where the log-probs are per response (summed over its tokens for DPO; IPO's paper uses the per-token
average, which the caller chooses by what it passes in). All inputs are (B,): one entry per pair.
- DPO (Rafailov et al. 2023): `-log sigmoid(beta h)`; with label smoothing eps (conservative DPO, the
  labels flipped with probability eps): `-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`.
- IPO (Azar et al. 2023): `(h - 1 / (2 beta))^2`, a squared loss that stops pushing once the margin is
  reached, so it cannot drive the policy to deterministic preferences.
"""

from __future__ import annotations

from typing import Protocol

import torch.nn.functional as F
from torch import Tensor


class PreferenceLoss(Protocol):
    """(policy_chosen, policy_rejected, ref_chosen, ref_rejected), each (B,) → (loss (), stats)."""

    def __call__(
        self,
        policy_chosen: Tensor,
        policy_rejected: Tensor,
        ref_chosen: Tensor,
        ref_rejected: Tensor,
        *,
        beta: float = 0.1,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


def preference_stats(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> dict[str, Tensor]:
    """Implicit rewards `beta * (log pi - log pi_ref)`, their margin and accuracy, batch means (detached)."""
    chosen = (beta * (policy_chosen - ref_chosen)).detach()
    rejected = (beta * (policy_rejected - ref_rejected)).detach()
    return {
        "rewards_chosen": chosen.mean(),
        "rewards_rejected": rejected.mean(),
        "reward_margin": (chosen - rejected).mean(),
        "reward_accuracy": (chosen > rejected).to(chosen.dtype).mean(),
    }


def _margin(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor
) -> Tensor:
    """`h` of the module docstring. (B,) → (B,)."""
    return (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)


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
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
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


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {"dpo": dpo_loss, "ipo": ipo_loss}
"""Offline preference losses by name."""
