"""The scored-group queue's conversions: (GeneratedSample, ItemResult) pairs -> ScoredGroup -> the
learner's GroupSamples, and a multi-turn sample's loss mask and turns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rlfabric.contracts.wire.common import REWARD_STATUS, finish_reason_from_proto, trace_to_proto
from rlfabric.learner.samples import GroupSamples, Rollout, Turn, TurnRole
from rlfabric.reward.spec import (
    ItemResult,
)
from rlfabric.v1 import common_pb2, queue_pb2, rollout_pb2

TURN_ROLE: dict[TurnRole, common_pb2.TurnRole] = {
    "model": common_pb2.TURN_ROLE_MODEL,
    "environment": common_pb2.TURN_ROLE_ENVIRONMENT,
    "tool": common_pb2.TURN_ROLE_TOOL,
}
"""Who produced a turn, on the wire (UNSPECIFIED is never sent)."""


TURN_ROLE_NAMES: dict[common_pb2.TurnRole, TurnRole] = {v: k for k, v in TURN_ROLE.items()}
"""The inverse of `TURN_ROLE`."""


def turn_role_from_proto(value: common_pb2.TurnRole) -> TurnRole:
    """A received turn role; an unset one reads as "environment". The role is provenance only: what is
    trained on is decided by the loss mask."""
    return TURN_ROLE_NAMES.get(value, "environment")


def scored_group(
    *,
    run_id: str,
    prompt_id: str,
    group_id: str,
    epoch: int,
    samples: Sequence[rollout_pb2.GeneratedSample],
    scores: Sequence[ItemResult],
    trace: Mapping[str, str],
    enqueued_at: float,
) -> queue_pb2.ScoredGroup:
    """A group's samples with their scores (`scores[i]` for `samples[i]`), stamped with the first
    sample's policy version and the scorer of the first score."""
    version = samples[0].policy_version
    return queue_pb2.ScoredGroup(
        run_id=run_id,
        prompt_id=prompt_id,
        group_id=group_id,
        epoch=epoch,
        prompt_token_ids=samples[0].prompt_token_ids,
        samples=[scored_sample(s, r, version) for s, r in zip(samples, scores, strict=True)],
        policy_version=version,
        scorer_name=scores[0].scorer_name,
        scorer_version=scores[0].scorer_version,
        trace=trace_to_proto(trace),
        enqueued_at=enqueued_at,
    )


def scored_sample(
    sample: rollout_pb2.GeneratedSample, score: ItemResult, version: int
) -> queue_pb2.ScoredSample:
    """One sample of a group with its reward (value, status and components; the message stays out), and
    a trajectory's loss mask, turns and tool counts."""
    scored = queue_pb2.ScoredSample(
        sample_index=sample.sample_index,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        text=sample.text,
        finish_reason=sample.finish_reason,
        policy_version=version,
        replica_id=sample.replica_id,
        reward=common_pb2.Reward(
            value=score.reward, status=REWARD_STATUS[score.status], components=score.components
        ),
    )
    if sample.HasField("trajectory"):
        t = sample.trajectory
        scored.loss_mask, scored.tool_calls, scored.tool_errors = t.loss_mask, t.tool_calls, t.tool_errors
        scored.turns.extend(t.turns)
    return scored


def decode_group(data: bytes) -> queue_pb2.ScoredGroup:
    """A stream entry's payload; raises `google.protobuf.message.DecodeError` for one that is no group."""
    return queue_pb2.ScoredGroup.FromString(data)


def group_versions(group: queue_pb2.ScoredGroup) -> set[int]:
    """Every policy version a group names: its own and each sample's."""
    return {group.policy_version, *(s.policy_version for s in group.samples)}


def group_samples_from_proto(group: queue_pb2.ScoredGroup) -> GroupSamples:
    """What the learner trains on: the prompt and the samples in sample-index order."""
    rollouts = [rollout_from_proto(s) for s in sorted(group.samples, key=lambda s: s.sample_index)]
    return GroupSamples(list(group.prompt_token_ids), rollouts, group.group_id)


def rollout_from_proto(sample: queue_pb2.ScoredSample) -> Rollout:
    """One scored sample as the learner trains on it, with its multi-turn fields when it has them."""
    return Rollout(
        token_ids=list(sample.token_ids),
        logprobs=list(sample.logprobs),
        reward=sample.reward.value,
        finish_reason=finish_reason_from_proto(sample.finish_reason),
        policy_version=sample.policy_version,
        components=dict(sample.reward.components),
        loss_mask=loss_mask_from_proto(sample.loss_mask),
        turns=[turn_from_proto(t) for t in sample.turns],
        tool_calls=sample.tool_calls,
        tool_errors=sample.tool_errors,
    )


def with_turns(
    sample: queue_pb2.ScoredSample, loss_mask: Sequence[int] | None, turns: Iterable[Turn]
) -> queue_pb2.ScoredSample:
    """`sample` with the multi-turn fields of a trajectory set: its loss mask (one 0/1 per completion
    token; None = all the policy's) and its turns. Returns the same message."""
    sample.loss_mask = loss_mask_to_proto(loss_mask)
    sample.turns.extend(turn_to_proto(t) for t in turns)
    return sample


def loss_mask_to_proto(mask: Sequence[int] | None) -> bytes:
    """One byte per completion token (1 = the policy's, 0 = the environment's); None is empty bytes."""
    return b"" if mask is None else bytes(mask)


def loss_mask_from_proto(data: bytes) -> list[int] | None:
    """The loss mask of a received sample; None when it has none (every token the policy's)."""
    return list(data) if data else None


def turn_to_proto(turn: Turn) -> common_pb2.Turn:
    """A turn on the wire; an unrewarded turn leaves `reward` unset."""
    message = common_pb2.Turn(start=turn.start, role=TURN_ROLE[turn.role])
    if turn.reward is not None:
        message.reward = turn.reward
    return message


def turn_from_proto(turn: common_pb2.Turn) -> Turn:
    """A received turn; an unset reward stays None (no reward, not 0)."""
    reward = turn.reward if turn.HasField("reward") else None
    return Turn(start=turn.start, role=turn_role_from_proto(turn.role), reward=reward)
