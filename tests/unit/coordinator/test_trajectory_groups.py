"""A multi-turn group on its way to the queue: what the coordinator counts of its trajectories, and the
trajectory's loss mask, turns and tool counts carried from the replica's sample into the ScoredSample the
learner reads (and back into the learner's Rollout)."""

from __future__ import annotations

import pytest

from rlfabric.contracts import wire
from rlfabric.contracts.keys import Counter
from rlfabric.contracts.trajectory import Turn
from rlfabric.coordinator.pipeline import trajectory_counts
from rlfabric.reward.spec import ItemResult
from rlfabric.rollout.trajectory import Trajectory


def played(status: str = "done", calls: int = 1, errors: int = 0) -> Trajectory:
    t = Trajectory(
        prompt_ids=[1, 2, 3],
        token_ids=[10, 11, 5, 20, 21, 22, 30, 5],
        logprobs=[-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5],
        loss_mask=[1, 1, 1, 0, 0, 0, 1, 1],
        turns=[Turn(0, "model", 0.5), Turn(3, "tool"), Turn(6, "model")],
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}],
        final_text="answer",
        tool_calls=calls,
        tool_errors=errors,
        prompt_tokens=12,
        cached_prompt_tokens=4,
    )
    return t.end(status, "" if status == "done" else "why")  # type: ignore[arg-type]


def sample(t: Trajectory, index: int = 0):  # type: ignore[no-untyped-def]
    return wire.trajectory_to_proto(
        t, index=(0, index), request_id="r", prompt_id="p", version=3, replica_id="rep", total_s=1.0
    )


def test_the_coordinator_counts_turns_tools_truncations_failures_and_cache_hits() -> None:
    samples = [
        sample(played()),
        sample(played("truncated", 2, 1), 1),
        sample(played("env_timeout"), 2),
        sample(played("template_mismatch"), 3),
    ]
    counts = trajectory_counts(samples)
    assert counts[Counter.TRAJECTORIES] == 4 and counts[Counter.TRAJECTORY_TURNS] == 8
    assert counts[Counter.TRAJECTORIES_TRUNCATED] == 1 and counts[Counter.ENVIRONMENT_ERRORS] == 1
    assert counts[Counter.TEMPLATE_MISMATCHES] == 1
    assert (counts[Counter.TOOL_CALLS], counts[Counter.TOOL_ERRORS]) == (5, 1)
    assert (counts[Counter.PREFIX_PROMPT_TOKENS], counts[Counter.PREFIX_CACHED_TOKENS]) == (48, 16)


def test_a_trajectory_reaches_the_learner_with_its_mask_turns_and_tools() -> None:
    t = played("truncated", 2, 1)
    generated = sample(t)
    assert generated.text == "answer" and wire.FINISH_REASON_NAMES[generated.finish_reason] == "length"
    assert wire.trajectory_status_from_proto(generated.trajectory.status) == "truncated"
    score = ItemResult(
        id="0",
        reward=1.0,
        status="ok",
        message="",
        components={},
        scorer_name="s",
        scorer_version="1",
        latency_s=0.0,
    )
    group = wire.scored_group(
        run_id="run", prompt_id="p", group_id="g", epoch=0, samples=[generated], scores=[score],
        trace={}, enqueued_at=0.0,
    )  # fmt: skip
    rollout = wire.group_samples_from_proto(wire.decode_group(group.SerializeToString())).rollouts[0]
    assert rollout.token_ids == t.token_ids and rollout.logprobs == pytest.approx(t.logprobs)
    assert rollout.loss_mask == t.loss_mask and rollout.turns == t.turns
    assert (rollout.tool_calls, rollout.tool_errors, rollout.reward) == (2, 1, 1.0)
    rollout.check("g")  # the learner's own validation accepts it
