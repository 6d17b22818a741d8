"""The clipped policy loss: values, clip-higher, dual clip, GSPO, TIS, aggregations and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric.learner.algorithms import AGGREGATIONS, PolicyLossConfig, aggregate, policy_loss


def _logp(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Current log-probs (with gradient) and old log-probs whose ratios are `ratios`."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0)
    logp = (old + torch.tensor(ratios).log()).requires_grad_()
    return logp, old


def test_ppo_clip_values_and_stats() -> None:
    logp, old = _logp([[1.5, 0.5, 1.0, 1.1]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 4), PolicyLossConfig())
    # max(-A r, -A clip(r)): -1.2 (clipped), 0.8 (clipped), -1.0, 1.1  -> mean -0.3 / 4
    assert loss.item() == pytest.approx(-0.075, abs=1e-6)
    assert stats["clip_fraction"].item() == 0.5
    assert stats["dual_clip_fraction"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(1.025)
    assert stats["ratio_max"].item() == pytest.approx(1.5)


def test_clipped_tokens_have_zero_gradient() -> None:
    logp, old = _logp([[1.5, 0.5, 1.5, 1.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 4), PolicyLossConfig())
    loss.backward()
    # d(-A r)/d logp = -A r, / 4 tokens; tokens 0 and 1 are clipped; token 2 (A < 0, r > 1+eps) is not
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.5 / 4, -2.0 / 4]]))


def test_clip_higher() -> None:
    logp, old = _logp([[1.25, 1.3]])
    cfg = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, stats = policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), cfg)
    # 1.25 < 1.28 is kept, 1.3 is clipped to 1.28
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2)
    assert stats["clip_fraction"].item() == 0.5


def test_dual_clip_caps_negative_advantage_loss() -> None:
    logp, old = _logp([[5.0, 5.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig())
    assert plain.item() == pytest.approx((5.0 - 1.2) / 2)  # -A r = 5; A > 0 clipped at -1.2
    loss, stats = policy_loss(logp, old, adv, mask, PolicyLossConfig(dual_clip=3.0))
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)  # min(5, -A c = 3)
    assert stats["dual_clip_fraction"].item() == 0.5
    loss.backward()
    assert logp.grad is not None
    assert torch.equal(logp.grad, torch.zeros(1, 2))


@pytest.mark.parametrize(
    ("mode", "normalisers"),
    [
        ("token_mean", [[5, 5, 5], [5, 5, 5]]),  # 5 valid tokens
        ("seq_mean_token_mean", [[6, 6, 6], [4, 4, 4]]),  # B=2 rows x their lengths 3 and 2
        ("seq_mean_token_sum", [[2, 2, 2], [2, 2, 2]]),  # B=2
        ("constant", [[8, 8, 8], [8, 8, 8]]),  # B=2 x max_tokens=4
    ],
)
def test_gradient_at_ratio_one_is_minus_advantage_over_normaliser(mode: str, normalisers: list) -> None:
    logp, old = _logp([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, -2.0, 3.0], [0.5, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = policy_loss(logp, old, adv, mask, PolicyLossConfig(aggregation=mode, max_tokens=4))
    loss.backward()
    expected = -adv * mask / torch.tensor(normalisers, dtype=torch.float32)
    torch.testing.assert_close(logp.grad, expected)
    assert stats["approx_kl"].item() == 0.0
    assert stats["clip_fraction"].item() == 0.0


def test_aggregations_hand_computed_with_fully_masked_row() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert set(AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"}
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "constant", max_tokens=4).item() == pytest.approx(10 / (3 * 4))


def test_aggregations_of_empty_mask_are_zero_and_bad_input_raises() -> None:
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), "constant")
    with pytest.raises(ValueError, match="unknown"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), "nope")


def test_gspo_uses_geometric_mean_ratio_and_matches_sequence_gradient() -> None:
    # token log-ratios 0.05 and 0.15 (and a padded 5.0 that must not count): s = exp(0.1)
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.05, 0.15, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    cfg = PolicyLossConfig(gspo=True, aggregation="seq_mean_token_mean")
    loss, stats = policy_loss(logp, old, torch.ones(1, 3), mask, cfg)
    s = math.exp(0.1)
    assert loss.item() == pytest.approx(-s)
    assert stats["ratio_max"].item() == pytest.approx(s)
    loss.backward()
    # the sequence objective -A * exp(mean_t log_ratio_t) has gradient -s / 2 on each valid token
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))


def test_gspo_clips_the_whole_sequence() -> None:
    # per-token ratios 1.5 and 1.0 (only one would be clipped token-wise); s = sqrt(1.5) = 1.2247 > 1.2
    logp, old = _logp([[1.5, 1.0]])
    cfg = PolicyLossConfig(gspo=True, aggregation="seq_mean_token_mean")
    loss, stats = policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), cfg)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clip_fraction"].item() == 1.0
    loss.backward()
    assert logp.grad is not None
    assert torch.equal(logp.grad, torch.zeros(1, 2))


def test_tis_weights_the_loss_and_reports_capping() -> None:
    logp, old = _logp([[1.0, 1.0]])
    rollout = old - torch.tensor([[math.log(0.5), math.log(3.0)]])  # exp(old - rollout) = 0.5, 3
    cfg = PolicyLossConfig(tis_cap=2.0)
    loss, stats = policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert stats["tis_weight_mean"].item() == pytest.approx(1.25)
    assert stats["tis_capped_fraction"].item() == 0.5
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -1.0]]))


def test_tis_off_without_cap() -> None:
    logp, old = _logp([[1.0]])
    loss, stats = policy_loss(logp, old, torch.ones(1, 1), torch.ones(1, 1), PolicyLossConfig(), old + 5)
    assert loss.item() == pytest.approx(-1.0)
    assert "tis_weight_mean" not in stats


def test_stats_ignore_padding_and_are_detached() -> None:
    logp, old = _logp([[1.1, 50.0]])
    _, stats = policy_loss(logp, old, torch.ones(1, 2), torch.tensor([[1, 0]]), PolicyLossConfig())
    assert stats["ratio_max"].item() == pytest.approx(1.1)
    # approx_kl: k3 = r - 1 - log r at r = 1.1
    assert stats["approx_kl"].item() == pytest.approx(0.1 - math.log(1.1), rel=1e-4)
    assert not any(v.requires_grad for v in stats.values())
