"""Advantage estimators: how much better than expected each sampled response (or token) was.

Two layers:
- Pure estimators with their natural shapes: the group ones map rewards `(G, n)` (G prompts, n samples
  each) to advantages `(G, n)`; `gae` and `discounted_returns` work on token rewards `(B, T)`.
- `ADVANTAGE_ESTIMATORS`, the names a run picks, all with one signature (`AdvantageEstimator`): token
  rewards `(B, T)` and the response mask in, token advantages and returns `(B, T)` out. A batch holds its
  groups as consecutive rows (rows `g*n .. g*n+n-1` are the n samples of prompt g). Sequence-level
  estimators score a response by the masked sum of its token rewards (the outcome reward on the last
  token, plus any per-token KL penalty), as verl does, so KL-in-reward works with every estimator.

Standard deviations are Bessel-corrected (unbiased), the convention of `torch.std` and of the GRPO
implementations in TRL, verl and OpenRLHF (DeepSeekMath writes `std(r)` without saying which).
Advantages carry no gradient: every estimator runs under `torch.no_grad()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from rlfabric.learner.algorithms.utils import masked_sum, masked_whiten

DEFAULT_EPS = 1e-6


# -- group (sequence-level) estimators: rewards (G, n) -> advantages (G, n) -------------------------


def grpo_advantages(rewards: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """GRPO: `(r - mean_group) / (std_group + eps)`, unbiased std. `rewards`: (G, n) → (G, n).

    A group whose rewards are all equal, or a group of one, gets exactly 0 (not NaN, nor rounding noise
    amplified by a tiny std): it carries no learning signal.
    """
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards)
    constant = _constant_groups(rewards)
    denom = torch.where(constant, 1.0, rewards.std(dim=-1, keepdim=True) + eps)
    return dr_grpo_advantages(rewards) / denom


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr.GRPO: `r - mean_group`, no std division (it biases towards too easy/hard prompts). (G, n).

    A group whose rewards are all equal gets exactly 0: in float32 the mean of equal values can miss
    them by an ulp (8 copies of 0.9 centre to -6e-8), noise that a later whitening over the batch
    (`reinforce_pp_baseline`) would blow up to +-1.
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    return torch.where(_constant_groups(rewards), torch.zeros_like(centred), centred)


def _constant_groups(rewards: Tensor) -> Tensor:
    """(G, n) → (G, 1) bool: the groups whose rewards are all exactly equal."""
    return rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO: `r_i - mean_{j != i} r_j` = `n/(n-1) * (r_i - mean)`. `rewards`: (G, n) → (G, n), n ≥ 2."""
    n = rewards.shape[-1]
    if n < 2:
        raise ValueError("RLOO needs at least 2 samples per group (the leave-one-out baseline)")
    return dr_grpo_advantages(rewards) * (n / (n - 1))


# -- token-level estimators: (B, T) ------------------------------------------------------------------


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Returns-to-go `G_t = r_t + gamma * G_{t+1}` over the masked tokens. All (B, T) → (B, T).

    Masked-out positions are skipped (their reward ignored, the running return carried through them),
    so interleaved non-trainable tokens (tool output) do not break the chain; they come out as 0.
    """
    m = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        step = token_rewards[:, t] + gamma * running
        running = m[:, t] * step + (1 - m[:, t]) * running
        returns[:, t] = running
    return returns * m


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), raw (not whitened).

    `token_rewards`, `values`, `mask`: (B, T). Returns `(advantages, returns)`, both (B, T), 0 where
    masked, with `returns = advantages + values`. `delta_t = r_t + gamma V_{t+1} - V_t`,
    `A_t = delta_t + gamma lam A_{t+1}`; the value after the last token is 0 (episode end). Masked-out
    positions are skipped: "next" means the next masked-in token, as in `discounted_returns`.
    """
    m = mask.to(values.dtype)
    values = values.detach()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = m[:, t] * adv + (1 - m[:, t]) * next_adv
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        advantages[:, t] = next_adv
    return advantages * m, (advantages + values) * m


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Give each token its sequence's value: `seq_values` (B,), `mask` (B, T) → (B, T), 0 where masked."""
    return seq_values.unsqueeze(-1) * mask.to(seq_values.dtype)


# -- the registry: one signature for every name a run can pick ---------------------------------------


class AdvantageEstimator(Protocol):
    """`token_rewards`, `mask`, `values`: (B, T) with B = G * group_size → (advantages, returns) (B, T)."""

    def __call__(
        self,
        token_rewards: Tensor,
        mask: Tensor,
        *,
        group_size: int,
        values: Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 0.95,
        eps: float = DEFAULT_EPS,
    ) -> tuple[Tensor, Tensor]: ...


def sequence_scores(token_rewards: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """A response's score is the masked sum of its token rewards: (B, T) → (G, group_size)."""
    if token_rewards.shape[0] % group_size:
        raise ValueError(f"batch of {token_rewards.shape[0]} rows is not whole groups of {group_size}")
    return masked_sum(token_rewards, mask, dim=-1).view(-1, group_size)


def _from_group_estimator(group_fn: Callable[[Tensor, float], Tensor]) -> AdvantageEstimator:
    """Lift a (G, n) → (G, n) estimator to the registry signature; returns equal the advantages."""

    @torch.no_grad()
    def estimate(
        token_rewards: Tensor,
        mask: Tensor,
        *,
        group_size: int,
        values: Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 0.95,
        eps: float = DEFAULT_EPS,
    ) -> tuple[Tensor, Tensor]:
        seq_adv = group_fn(sequence_scores(token_rewards, mask, group_size), eps).reshape(-1)
        advantages = broadcast_to_tokens(seq_adv, mask)
        return advantages, advantages

    return estimate


@torch.no_grad()
def reinforce_pp(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    group_size: int,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = DEFAULT_EPS,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): returns-to-go, whitened over every valid token of the batch (no critic).

    With an outcome reward only and gamma = 1 every token of a response carries its reward r, so this is
    `(r - mean_batch) / std_batch` with the batch statistics weighted by response length. A batch whose
    returns are all equal gets exactly 0 (`masked_whiten`'s invariant 1).
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps), returns


@torch.no_grad()
def reinforce_pp_baseline(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    group_size: int,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = DEFAULT_EPS,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean score, broadcast to tokens, whiten over the
    batch. Needs groups of n >= 2 (a group of one centres to 0). A batch of groups that are each all equal
    gets exactly 0, whatever their values (`dr_grpo_advantages` centres them to exactly 0)."""
    centred = dr_grpo_advantages(sequence_scores(token_rewards, mask, group_size)).reshape(-1)
    returns = broadcast_to_tokens(centred, mask)
    return masked_whiten(returns, mask, eps), returns


@torch.no_grad()
def gae_estimator(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    group_size: int,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = DEFAULT_EPS,
) -> tuple[Tensor, Tensor]:
    """PPO: `gae`, advantages whitened over the batch's valid tokens; returns stay raw (critic targets)."""
    if values is None:
        raise ValueError("gae needs the critic's values")
    advantages, returns = gae(token_rewards, values, mask, gamma, lam)
    return masked_whiten(advantages, mask, eps), returns


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": _from_group_estimator(lambda r, eps: grpo_advantages(r, eps)),
    "dr_grpo": _from_group_estimator(lambda r, eps: dr_grpo_advantages(r)),
    "rloo": _from_group_estimator(lambda r, eps: rloo_advantages(r)),
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": gae_estimator,
}
"""Advantage estimators by the name a run picks (`AlgorithmSpec.advantage`)."""
