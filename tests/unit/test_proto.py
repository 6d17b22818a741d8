"""The queue payload survives serialisation exactly, and the contracts hold what the services rely on."""

from __future__ import annotations

from rlfabric.v1 import common_pb2, learner_pb2, queue_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc


def make_group() -> queue_pb2.ScoredGroup:
    samples = [
        queue_pb2.ScoredSample(
            sample_index=i,
            token_ids=[5, 6, 7 + i],
            logprobs=[-0.5, -1.25, -0.125 * i],
            text=f"answer {i}",
            finish_reason=common_pb2.FINISH_REASON_STOP if i else common_pb2.FINISH_REASON_LENGTH,
            policy_version=3,
            replica_id="rollout-0",
            reward=common_pb2.Reward(
                value=float(i),
                status=common_pb2.REWARD_STATUS_OK if i != 2 else common_pb2.REWARD_STATUS_SCORER_ERROR,
                message="" if i != 2 else "ZeroDivisionError",
                components={"format": 1.0, "correct": float(i % 2)},
            ),
        )
        for i in range(4)
    ]
    return queue_pb2.ScoredGroup(
        run_id="run-1",
        prompt_id="p-17",
        group_id="p-17:e0:a1",
        epoch=0,
        prompt_token_ids=[1, 2, 3],
        samples=samples,
        policy_version=3,
        scorer_name="math_verify",
        scorer_version="0.9.0",
        trace=common_pb2.TraceContext(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        enqueued_at=1764672000.25,
    )


def test_scored_group_round_trips_bit_for_bit() -> None:
    group = make_group()
    data = group.SerializeToString(deterministic=True)
    back = queue_pb2.ScoredGroup.FromString(data)
    assert back == group
    assert back.SerializeToString(deterministic=True) == data
    assert back.samples[2].reward.status == common_pb2.REWARD_STATUS_SCORER_ERROR
    assert list(back.samples[1].logprobs) == [-0.5, -1.25, -0.125]
    assert dict(back.samples[3].reward.components) == {"format": 1.0, "correct": 1.0}


def test_unset_reward_status_is_distinguishable_from_ok() -> None:
    """A sample nobody scored must never read as a valid reward of 0."""
    sample = queue_pb2.ScoredSample.FromString(queue_pb2.ScoredSample(sample_index=1).SerializeToString())
    assert sample.reward.status == common_pb2.REWARD_STATUS_UNSPECIFIED != common_pb2.REWARD_STATUS_OK


def test_prompt_forms_are_exclusive() -> None:
    prompt = common_pb2.Prompt(text="hi")
    prompt.token_ids.ids.extend([1, 2])
    assert prompt.WhichOneof("kind") == "token_ids"
    assert not prompt.HasField("text")


def test_generate_is_server_streaming() -> None:
    method = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name["Generate"]
    assert method.server_streaming and not method.client_streaming


def test_services_expose_the_contracted_rpcs() -> None:
    def rpcs(module: object, service: str) -> set[str]:
        return {m.name for m in module.DESCRIPTOR.services_by_name[service].methods}  # type: ignore[attr-defined]

    assert rpcs(rollout_pb2, "RolloutService") == {"Generate", "UpdateWeights", "UnloadAdapter", "GetInfo"}
    assert rpcs(reward_pb2, "RewardService") == {"Score", "ListScorers", "CheckScorer"}
    assert rpcs(learner_pb2, "LearnerService") == {"GetStatus"}
    assert hasattr(rollout_pb2_grpc, "RolloutServiceServicer")
