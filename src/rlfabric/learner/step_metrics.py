"""A learner step's metrics: this rank's per-sample sums (summed over the ranks by the trainer), then the
global means and spreads reported for the step."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlfabric.learner.algorithms import masked_sum
from rlfabric.learner.batch import MicroBatch, StepBatch, attached
from rlfabric.learner.critic import critic_metrics


def sample_sums(sb: StepBatch, micro_batches: list[MicroBatch], device: torch.device) -> dict[str, Tensor]:
    """Per-sample and per-advantage-token sums of this rank's share, on `device`."""
    lengths = sb.lengths.float()
    adv_sum, adv_sq, adv_tokens = (torch.zeros((), device=device) for _ in range(3))
    for mb in micro_batches:
        advantages = attached(mb.advantages)  # (B, T)
        adv_sum = adv_sum + masked_sum(advantages, mb.loss_mask)
        adv_sq = adv_sq + masked_sum(advantages**2, mb.loss_mask)
        adv_tokens = adv_tokens + mb.loss_mask.sum()
    grouped = sb.rewards.view(-1, sb.group_size)  # (groups, group size)
    if sb.group_size < 2:  # a one-sample group is trivially uniform: no group estimator runs on it
        grouped = grouped[:0]
    uniform = grouped.amax(-1) == grouped.amin(-1)
    return {
        "groups": torch.tensor(float(grouped.shape[0]), device=device),
        "groups_uniform": uniform.sum().float().to(device),
        "samples": torch.tensor(float(sb.rewards.numel()), device=device),
        "reward_sum": sb.rewards.sum().to(device),
        "reward_sq": (sb.rewards**2).sum().to(device),
        "length_sum": lengths.sum().to(device),
        "adv_sum": adv_sum,
        "adv_sq": adv_sq,
        "adv_tokens": adv_tokens,
    }


TOKEN_MEANS = ("kl", "entropy", "clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean")
TOKEN_MEANS_OPTIONAL = (
    "tis_weight_mean",
    "tis_capped_fraction",
    "rollout_masked_fraction",
    "rollout_mismatch_kl",
    "rollout_logprob_abs_diff",
)


def mean_std(total: float, squares: float, count: float) -> tuple[float, float]:
    """Mean and (population) standard deviation from a sum, a sum of squares and a count."""
    n = max(count, 1.0)
    mean = total / n
    return mean, math.sqrt(max(squares / n - mean**2, 0.0))


def step_metrics(total: dict[str, float]) -> dict[str, float]:
    """Step metrics from globally summed statistics. `uniform_reward_groups_fraction`: the share of the
    step's groups whose samples all got the same reward, which a group estimator learns nothing from
    (unless turn rewards differ; absent with one sample a prompt): near 1 with all rewards at the top,
    the task is solved for these prompts; at the bottom, too hard; on a warm-started policy whose
    samples barely differ (low entropy), RL has little to work with."""
    tokens = max(total["tokens"], 1.0)
    metrics = {"loss": total["loss"], "policy_loss": total["policy_loss"], "tokens": total["tokens"]}
    for name in (*TOKEN_MEANS, *(n for n in TOKEN_MEANS_OPTIONAL if n in total)):
        metrics[name] = total[name] / tokens
    metrics["reward_mean"], metrics["reward_std"] = mean_std(
        total["reward_sum"], total["reward_sq"], total["samples"]
    )
    metrics["advantage_mean"], metrics["advantage_std"] = mean_std(
        total["adv_sum"], total["adv_sq"], total["adv_tokens"]
    )
    if total["groups"] > 0:
        metrics["uniform_reward_groups_fraction"] = total["groups_uniform"] / total["groups"]
    metrics["response_length_mean"] = total["length_sum"] / max(total["samples"], 1.0)
    metrics["samples"] = total["samples"]
    if "value_loss" in total:
        metrics.update(critic_metrics(total))
    return metrics
