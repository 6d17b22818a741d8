"""Advantage estimators against hand-computed values.

GRPO's std is Bessel-corrected: for rewards [1, 0, 0, 1] the mean is 0.5 and the std is
sqrt(4 * 0.25 / 3) = sqrt(1/3), so the advantages are +-0.5 / sqrt(1/3) = +-sqrt(3)/2 = +-0.8660254.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric.learner.algorithms import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    discounted_returns,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
)

HALF_SQRT3 = math.sqrt(3) / 2


def test_registry_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
    }


def test_grpo_normalises_per_group_with_unbiased_std() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 4.0]])
    # second group: mean 4, deviations -2 0 2 0, unbiased std sqrt(8/3)
    s = math.sqrt(8 / 3)
    expected = torch.tensor([[HALF_SQRT3, -HALF_SQRT3, -HALF_SQRT3, HALF_SQRT3], [-2 / s, 0.0, 2 / s, 0.0]])
    torch.testing.assert_close(grpo_advantages(rewards, eps=0.0), expected)


def test_grpo_equal_rewards_and_single_sample_groups_give_zero() -> None:
    assert torch.equal(grpo_advantages(torch.full((2, 4), 3.0)), torch.zeros(2, 4))
    assert torch.equal(grpo_advantages(torch.full((2, 4), 3.0), eps=0.0), torch.zeros(2, 4))
    assert torch.equal(grpo_advantages(torch.full((1, 7), 0.1)), torch.zeros(1, 7))
    assert torch.equal(grpo_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))


def test_dr_grpo_centres_without_std() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 4.0]])
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-2.0, 0.0, 2.0, 0.0]])
    torch.testing.assert_close(dr_grpo_advantages(rewards), expected)


def test_rloo_leave_one_out_baseline() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 4.0]])
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; 2 - mean(4, 6, 4) = -8/3; 4 - 4 = 0; 6 - 10/3 = 8/3
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-8 / 3, 0.0, 8 / 3, 0.0]])
    torch.testing.assert_close(rloo_advantages(rewards), expected)
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.ones(3, 1))


def test_broadcast_to_tokens() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    assert torch.equal(broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask), expected)


def test_registry_grpo_scores_by_token_reward_sum_and_broadcasts() -> None:
    # two groups of two; the outcome sits on the last valid token, a KL penalty on the others
    token_rewards = torch.tensor([[-0.1, -0.1, 1.0], [0.0, 0.0, 9.0], [0.5, 0.0, 0.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    # scores: 0.8, 0.0 | 0.5, 0.5 -> group 1: mean 0.4, unbiased std sqrt(2 * 0.16) = 0.4*sqrt(2)
    a = 0.4 / (0.4 * math.sqrt(2))
    adv, returns = ADVANTAGE_ESTIMATORS["grpo"](token_rewards, mask, group_size=2, eps=0.0)
    expected = torch.tensor([[a, a, a], [-a, -a, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    assert torch.equal(returns, adv)


def test_registry_rejects_partial_groups() -> None:
    with pytest.raises(ValueError, match="whole groups"):
        ADVANTAGE_ESTIMATORS["dr_grpo"](torch.zeros(3, 2), torch.ones(3, 2), group_size=2)


def test_discounted_returns_skip_masked_positions() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, 8.0], [1.0, 5.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])
    # row 0: G2 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75
    # row 1: the masked token (reward 5) is skipped: G2 = 3, G0 = 1 + 0.5*3 = 2.5
    expected = torch.tensor([[2.75, 3.5, 3.0, 0.0], [2.5, 0.0, 3.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=0.5), expected)


def test_reinforce_pp_whitens_returns_over_the_batch() -> None:
    token_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    # gamma 1: returns [[1, 1], [0, 0]]; over 4 tokens mean 0.5, unbiased std sqrt(1/3)
    adv, returns = ADVANTAGE_ESTIMATORS["reinforce_pp"](token_rewards, mask, group_size=2, eps=0.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    expected = torch.tensor([[HALF_SQRT3, HALF_SQRT3], [-HALF_SQRT3, -HALF_SQRT3]])
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens() -> None:
    token_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    mask = torch.ones(4, 2)
    # centred scores 0.5, -0.5 | 0, 0 on 8 tokens: mean 0, unbiased var 4 * 0.25 / 7 = 1/7
    a = 0.5 * math.sqrt(7)
    adv, returns = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](token_rewards, mask, group_size=2, eps=0.0)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]]))


def test_estimators_carry_no_gradient() -> None:
    token_rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        adv, _ = ADVANTAGE_ESTIMATORS[name](token_rewards, torch.ones(2, 2), group_size=2)
        assert not adv.requires_grad, name


@pytest.mark.parametrize(("value", "old_result"), [(0.9, -0.151), (0.1, 0.0074)])
def test_reinforce_pp_of_an_all_equal_float32_batch_is_exactly_zero(value: float, old_result: float) -> None:
    """30 one-token responses with the same reward: no learning signal. The float32 batch mean misses the
    value by an ulp; whitening used to turn that into the same advantage `old_result` on every token."""
    token_rewards = torch.full((30, 1), value)
    adv, returns = ADVANTAGE_ESTIMATORS["reinforce_pp"](token_rewards, torch.ones(30, 1), group_size=5)
    assert torch.equal(returns, token_rewards)
    assert torch.equal(adv, torch.zeros(30, 1)), (adv[0, 0].item(), old_result)
    padded = torch.cat([torch.zeros(30, 3), token_rewards], dim=1)  # the reward on the last of 4 tokens
    adv, _ = ADVANTAGE_ESTIMATORS["reinforce_pp"](padded, torch.ones(30, 4), group_size=5)
    assert torch.equal(adv, torch.zeros(30, 4))


def test_group_centring_of_equal_float32_rewards_is_exactly_zero() -> None:
    """8 copies of 0.9 centre to -6e-8 in float32; the baseline estimator then whitened such noise over a
    batch of all-constant groups into advantages of +-1."""
    rewards = torch.tensor([[0.9] * 8, [0.1] * 8])
    assert (rewards - rewards.mean(dim=-1, keepdim=True)).abs().max().item() > 0  # the rounding
    assert torch.equal(dr_grpo_advantages(rewards), torch.zeros(2, 8))
    assert torch.equal(rloo_advantages(rewards), torch.zeros(2, 8))
    token_rewards = torch.zeros(16, 3)
    token_rewards[:, -1] = rewards.reshape(-1)
    adv, returns = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](
        token_rewards, torch.ones(16, 3), group_size=8
    )
    assert torch.equal(returns, torch.zeros(16, 3))
    assert torch.equal(adv, torch.zeros(16, 3))


def test_every_estimator_a_run_file_can_name_is_registered_and_back() -> None:
    from typing import get_args

    from rlfabric.runspec import AlgorithmSpec

    names = set(get_args(AlgorithmSpec.model_fields["advantage"].annotation))
    assert names == set(ADVANTAGE_ESTIMATORS)


def test_run_file_selects_reinforce_pp_baseline_with_groups_of_two_or_more() -> None:
    from rlfabric.runspec import RunSpec
    from rlfabric.runtime.config import ConfigError, load_config

    base = [
        "model.path=m",
        "dataset.path=d",
        "reward.scorer=exact_match",
        "algorithm.advantage=reinforce_pp_baseline",
    ]
    spec = load_config(RunSpec, overrides=[*base, "rollout.sampling.n=4"])
    assert spec.algorithm.advantage == "reinforce_pp_baseline"
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.n must be >= 2"):
        load_config(RunSpec, overrides=[*base, "rollout.sampling.n=1"])
