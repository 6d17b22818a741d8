"""GAE against a hand-unrolled recursion, including padding and masked tokens inside a response."""

from __future__ import annotations

import pytest
import torch

from rlfabric.learner.algorithms import ADVANTAGE_ESTIMATORS, gae


def test_gae_hand_computed_with_right_padding() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72); the value after the last valid token is 0
    # t=2: delta = 1 - 0.7 = 0.3;              A2 = 0.3
    # t=1: delta = 0.9*0.7 - 0.6 = 0.03;       A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04;       A0 = 0.04 + 0.72*0.246 = 0.21712
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))


def test_gae_with_gamma_lam_one_is_return_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(returns, torch.ones(1, 3))


def test_gae_skips_masked_tokens_inside_a_response() -> None:
    rewards = torch.tensor([[0.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[1, 0, 1]])
    # t=2: A2 = 1 - 0.7 = 0.3; t=1 skipped; t=0: delta = 0.9*0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72*0.3 = 0.346
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.346, 0.0, 0.3]]))


def test_fully_masked_row_gives_zeros() -> None:
    adv, returns = gae(torch.ones(1, 3), torch.ones(1, 3), torch.zeros(1, 3))
    assert torch.equal(adv, torch.zeros(1, 3))
    assert torch.equal(returns, torch.zeros(1, 3))


def test_registry_gae_whitens_advantages_keeps_raw_returns() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, returns = ADVANTAGE_ESTIMATORS["gae"](
        rewards, torch.ones(1, 3), group_size=1, values=values, gamma=1.0, lam=1.0, eps=0.0
    )
    # raw advantages 0.5, 0.4, 0.3: mean 0.4, unbiased std 0.1
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, -1.0]]))
    torch.testing.assert_close(returns, torch.ones(1, 3))
    with pytest.raises(ValueError, match="values"):
        ADVANTAGE_ESTIMATORS["gae"](rewards, torch.ones(1, 3), group_size=1)
