"""Micro-batching of scored groups: padding, masks and the target alignment, checked by hand."""

from __future__ import annotations

import pytest
import torch

from rlfabric.learner.batch import (
    GroupSamples,
    Rollout,
    StepBatch,
    build_micro_batches,
    empty_micro_batch,
    shard_groups,
)

PAD = 0


def _groups() -> list[GroupSamples]:
    return [
        GroupSamples(
            [10, 11, 12],
            [Rollout([20, 21], [-0.5, -0.25], 1.0), Rollout([30], [-1.0], 0.0, finish_reason="length")],
            group_id="g0",
        ),
        GroupSamples(
            [13], [Rollout([40, 41, 42], [-0.1, -0.2, -0.3], 0.5), Rollout([50], [-2.0], 0.0)], group_id="g1"
        ),
    ]


def test_micro_batches_are_padded_to_their_own_longest_sequence() -> None:
    mb0, mb1 = build_micro_batches(_groups(), micro_batch_size=2, pad_id=PAD)
    assert mb0.input_ids.tolist() == [[10, 11, 12, 20, 21], [10, 11, 12, 30, PAD]]
    assert mb0.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert mb1.input_ids.tolist() == [[13, 40, 41, 42], [13, 50, PAD, PAD]]
    assert mb1.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_loss_mask_and_rollout_logprobs_sit_at_the_position_that_predicts_each_completion_token() -> None:
    mb0, mb1 = build_micro_batches(_groups(), micro_batch_size=2, pad_id=PAD)
    # Position t predicts token t+1: the first completion token (index P) is predicted at P - 1.
    assert mb0.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]]
    assert mb0.rollout_logprobs.tolist() == [[0, 0, -0.5, -0.25, 0], [0, 0, -1.0, 0, 0]]
    assert mb1.loss_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert mb1.rollout_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    assert mb0.targets(PAD).tolist() == [[11, 12, 20, 21, PAD], [11, 12, 30, PAD, PAD]]
    assert mb0.completion_start.tolist() == [2, 2]
    assert mb1.completion_start.tolist() == [0, 0]


def test_every_masked_target_is_a_completion_token_with_its_rollout_logprob() -> None:
    groups = _groups()
    samples = [(g.prompt_token_ids, r) for g in groups for r in g.rollouts]
    for mb in build_micro_batches(groups, micro_batch_size=3, pad_id=PAD):
        targets = mb.targets(PAD)
        for b, index in enumerate(mb.sample_index.tolist()):
            _, rollout = samples[index]
            picked = mb.loss_mask[b].bool()
            assert targets[b][picked].tolist() == rollout.token_ids
            assert mb.rollout_logprobs[b][picked].tolist() == pytest.approx(rollout.logprobs)


def test_rows_keep_their_group_and_step_index_and_reward() -> None:
    mbs = build_micro_batches(_groups(), micro_batch_size=3, pad_id=PAD)
    assert [mb.group_index.tolist() for mb in mbs] == [[0, 0, 1], [1]]
    assert [mb.sample_index.tolist() for mb in mbs] == [[0, 1, 2], [3]]
    assert mbs[0].rewards.tolist() == [1.0, 0.0, 0.5]
    assert [mb.num_tokens for mb in mbs] == [6, 1]


def test_by_length_puts_sequences_of_similar_length_together_and_keeps_their_identity() -> None:
    # Sequence lengths (prompt + completion) in step order: 5, 4, 4, 2.
    mbs = build_micro_batches(_groups(), micro_batch_size=2, pad_id=PAD, by_length=True)
    assert [mb.sample_index.tolist() for mb in mbs] == [[3, 1], [2, 0]]
    assert [mb.group_index.tolist() for mb in mbs] == [[1, 0], [1, 0]]
    assert [mb.rewards.tolist() for mb in mbs] == [[0.0, 0.0], [0.5, 1.0]]
    assert mbs[0].input_ids.tolist() == [[13, 50, PAD, PAD], [10, 11, 12, 30]]
    assert mbs[1].input_ids.tolist() == [[13, 40, 41, 42, PAD], [10, 11, 12, 20, 21]]
    in_order = build_micro_batches(_groups(), micro_batch_size=2, pad_id=PAD)
    padded = [sum(mb.input_ids.numel() for mb in batches) for batches in (mbs, in_order)]
    assert padded == [18, 18]  # this tiny step gains nothing; a step of mixed lengths does:
    lengths = [1, 30, 2, 29, 3, 28, 4, 27]
    mixed = [GroupSamples([9], [Rollout([5] * n, [-1.0] * n, 0.0) for n in lengths])]
    sizes = [
        [mb.input_ids.shape[1] for mb in build_micro_batches(mixed, 2, PAD, by_length=flag)]
        for flag in (True, False)
    ]
    assert sizes == [[3, 5, 29, 31], [31, 30, 29, 28]]


def test_step_batch_is_the_completion_layout() -> None:
    sb = StepBatch.from_groups(_groups())
    assert sb.group_size == 2
    assert sb.lengths.tolist() == [2, 1, 3, 1]
    assert sb.truncated.tolist() == [False, True, False, False]
    assert sb.completion_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert sb.outcome_token_rewards(sb.rewards).tolist() == [[0, 1, 0], [0, 0, 0], [0, 0, 0.5], [0, 0, 0]]


def test_completion_and_target_layouts_round_trip() -> None:
    sb = StepBatch.from_groups(_groups())
    values = torch.arange(1.0, 13.0).view(4, 3)
    mb0, mb1 = build_micro_batches(_groups(), micro_batch_size=2, pad_id=PAD)
    assert mb0.from_completion_layout(values, sb.completion_mask).tolist() == [
        [0, 0, 1, 2, 0],
        [0, 0, 4, 0, 0],
    ]
    target = mb1.from_completion_layout(values, sb.completion_mask)
    assert target.tolist() == [[7, 8, 9, 0], [10, 0, 0, 0]]
    assert mb1.to_completion_layout(target, 3).tolist() == [[7, 8, 9], [10, 0, 0]]


def test_groups_of_different_sizes_and_mismatched_logprobs_are_rejected() -> None:
    groups = [*_groups(), GroupSamples([1], [Rollout([2], [-1.0], 0.0)])]
    with pytest.raises(ValueError, match="different sizes"):
        StepBatch.from_groups(groups)
    with pytest.raises(ValueError, match="logprobs"):
        GroupSamples([1], [Rollout([2, 3], [-1.0], 0.0)])
    with pytest.raises(ValueError, match="empty prompt"):
        GroupSamples([], [Rollout([2], [-1.0], 0.0)])


def test_sharding_is_round_robin_and_covers_every_group_once() -> None:
    groups = [GroupSamples([i], [Rollout([1], [0.0], 0.0)], group_id=str(i)) for i in range(5)]
    shards = [shard_groups(groups, rank, 2) for rank in range(2)]
    assert [[g.group_id for g in shard] for shard in shards] == [["0", "2", "4"], ["1", "3"]]


def test_empty_micro_batch_trains_nothing() -> None:
    mb = empty_micro_batch(PAD)
    assert mb.num_tokens == 0
    assert mb.sample_index.tolist() == [-1]
