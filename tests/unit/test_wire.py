"""`rlfabric.contracts.wire`: every proto <-> domain conversion round-trips, each enum map's inverse is
total over the enum, and no conversion lives anywhere else in the package."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlfabric.contracts import wire
from rlfabric.reward.spec import ItemResult, ScoredBatch, ScoreInput, ScoreResult, ScorerSpec
from rlfabric.rollout.types import FINISH_REASONS, EngineSample, InvalidSampling, SamplingSettings
from rlfabric.runspec import RewardSpec, SamplingSpec
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.v1 import common_pb2, reward_pb2, rollout_pb2
from rlfabric.weights.broadcast import TensorMeta

SRC = Path(__file__).resolve().parents[2] / "src" / "rlfabric"


def enum_values(enum: object) -> set[int]:
    """Every value of a generated enum but UNSPECIFIED (never sent)."""
    return {v for name, v in enum.items() if not name.endswith("_UNSPECIFIED")}  # type: ignore[attr-defined]


def test_reward_status_map_and_its_inverse_are_total() -> None:
    assert set(wire.REWARD_STATUS.values()) == enum_values(common_pb2.RewardStatus)
    assert set(wire.REWARD_STATUS_NAMES) == enum_values(common_pb2.RewardStatus)
    for name, value in wire.REWARD_STATUS.items():
        assert wire.reward_status_from_proto(value) == name
    assert wire.reward_status_from_proto(common_pb2.REWARD_STATUS_UNSPECIFIED) == "scorer_error"


def test_finish_reason_map_and_its_inverse_are_total() -> None:
    assert set(wire.FINISH_REASON) == set(FINISH_REASONS)
    assert set(wire.FINISH_REASON_NAMES) == enum_values(common_pb2.FinishReason)
    for name, value in wire.FINISH_REASON.items():
        assert wire.finish_reason_from_proto(value) == name
    assert wire.finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) == "stop"


def test_prompts_text_messages_and_the_chat_template_option() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert wire.prompt_to_proto("hi") == common_pb2.Prompt(text="hi")
    assert wire.text_prompt_from_proto(wire.prompt_to_proto("hi")) == "hi"
    assert wire.text_prompt_from_proto(wire.prompt_to_proto(chat)) == chat
    as_chat = wire.prompt_to_proto("hi", chat_template=True)
    assert wire.text_prompt_from_proto(as_chat) == [{"role": "user", "content": "hi"}]
    assert wire.text_prompt_from_proto(common_pb2.Prompt()) == ""
    with pytest.raises(InvalidArgument, match=r"prompt\.token_ids"):
        wire.text_prompt_from_proto(common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[1])))


def test_named_and_composite_scorer_specs_round_trip() -> None:
    named = ScorerSpec("regex", {"pattern": "x+", "flags": ["i"]})
    assert wire.scorer_spec_from_proto(wire.scorer_spec_to_proto(named)) == named
    reward = RewardSpec.model_validate(
        {
            "scorer": "composite",
            "parts": [{"scorer": "exact_match", "weight": 0.5}, {"scorer": "regex", "alias": "r"}],
        }
    )
    composite = wire.scorer_spec_from_proto(wire.scorer_spec_to_proto(to_spec(reward)))
    assert composite == to_spec(reward)
    assert [p["alias"] for p in composite.params["parts"]] == ["exact_match", "r"]


def to_spec(reward: RewardSpec) -> ScorerSpec:
    from rlfabric.reward.spec import spec_from_reward_spec

    return spec_from_reward_spec(reward)


def test_scorer_spec_without_a_name_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match=r"^scorer: set either"):
        wire.scorer_spec_from_proto(reward_pb2.ScorerSpec())
    with pytest.raises(InvalidArgument, match=r"scorer\.named\.name"):
        wire.scorer_spec_from_proto(reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer()))
    part = reward_pb2.WeightedScorer(scorer=reward_pb2.NamedScorer())
    bad = reward_pb2.ScorerSpec(composite=reward_pb2.CompositeScorer(parts=[part]))
    with pytest.raises(InvalidArgument, match=r"parts\[0\]\.scorer\.name"):
        wire.scorer_spec_from_proto(bad)


def test_items_round_trip_and_results_come_back_with_nan_for_failures() -> None:
    items = [
        ScoreInput("a", "Q", "c", "r", {"tests": [1.0, 2.0], "tag": "x"}),
        ScoreInput("b", [{"role": "user", "content": "Q"}], "", "", {}),
    ]
    request = wire.score_request(items, ScorerSpec("exact_match"), None)
    assert request.item_timeout_seconds == 0.0 and not request.items[1].HasField("metadata")
    assert [wire.item_from_proto(i, x) for i, x in enumerate(request.items)] == items
    results = [ScoreResult.ok(1.0, {"p": 1.0}), ScoreResult.timed_out("slow")]
    response = wire.score_response(items, ScoredBatch(results, "exact_match", "exact_match@1", 0.5))
    ok, slow = (wire.item_result_from_proto(r) for r in response.results)
    assert ok == ItemResult("a", 1.0, "ok", "", {"p": 1.0}, "exact_match", "exact_match@1", 0.5)
    assert math.isnan(slow.reward) and (slow.status, slow.message) == ("timeout", "slow")


def test_scorer_descriptions_round_trip() -> None:
    from rlfabric.reward.spec import ParamInfo, ScorerInfo

    info = ScorerInfo("regex", "2", "matches", (ParamInfo("pattern", "string", None, "the regex", True),))
    response = reward_pb2.ListScorersResponse(scorers=[wire.scorer_description_to_proto(info)])
    (described,) = wire.scorer_descriptions_from_proto(response)
    assert described["name"] == "regex" and described["params"][0]["required"] is True


def test_sampling_applies_wire_defaults_and_one_validation() -> None:
    spec = SamplingSpec(n=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=16, stop=["\n"])
    settings = wire.sampling_from_proto(wire.sampling_to_proto(spec))
    assert (settings.n, settings.top_k, settings.max_tokens, settings.stop) == (4, 20, 16, ("\n",))
    assert (settings.temperature, settings.top_p) == pytest.approx((0.7, 0.9))
    defaults = wire.sampling_from_proto(rollout_pb2.SamplingParams(max_tokens=8))
    assert (defaults.n, defaults.top_p, defaults.top_k, defaults.seed) == (1, 1.0, -1, None)
    with pytest.raises(InvalidArgument, match=r"sampling\.max_tokens: required"):
        wire.sampling_from_proto(rollout_pb2.SamplingParams())
    with pytest.raises(InvalidSampling, match=r"sampling\.top_k") as wired:
        wire.sampling_from_proto(rollout_pb2.SamplingParams(max_tokens=8, top_k=-2))
    with pytest.raises(InvalidSampling) as built:
        SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=-2, max_tokens=8)
    assert str(wired.value) == str(built.value)  # one rule, one message, wherever it is checked


def test_generated_samples_become_scored_groups_and_then_training_groups() -> None:
    engine = EngineSample(0, 1, [5, 6], [7, 8], [-0.5, -0.25], "ab", "length", 0.1, 0.2)
    sample = wire.sample_to_proto(engine, request_id="r", prompt_id="p", version=3, replica_id="x")
    first = rollout_pb2.GeneratedSample(
        sample_index=0, prompt_token_ids=[5, 6], token_ids=[9], logprobs=[-1.0]
    )
    first.policy_version = 3
    scores = [
        ItemResult("0", 0.0, "ok", "", {}, "exact_match", "exact_match@1", 0.0),
        ItemResult("1", 1.0, "ok", "", {"p": 1.0}, "exact_match", "exact_match@1", 0.0),
    ]
    carrier = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    group = wire.scored_group(
        run_id="run",
        prompt_id="p",
        group_id="p:e0",
        epoch=0,
        samples=[sample, first][::-1],
        scores=scores,
        trace=carrier,
        enqueued_at=1.0,
    )
    decoded = wire.decode_group(group.SerializeToString())
    assert wire.trace_from_proto(decoded.trace) == carrier
    assert wire.group_versions(decoded) == {3}
    training = wire.group_samples_from_proto(decoded)
    assert training.prompt_token_ids == [5, 6] and training.group_id == "p:e0"
    assert [(r.token_ids, r.reward, r.finish_reason) for r in training.rollouts] == [
        ([9], 0.0, "stop"),
        ([7, 8], 1.0, "length"),
    ]


def test_tensor_metas_and_broadcast_plans() -> None:
    metas = [TensorMeta("w", "bfloat16", (2, 3)), TensorMeta("b", "float32", ())]
    assert wire.metas_from_proto(wire.metas_to_proto(metas)) == metas
    source = rollout_pb2.BroadcastSource(
        master_address="h", master_port=7, rank=1, world_size=2, tensors=wire.metas_to_proto(metas)
    )
    plan = wire.broadcast_from_proto(source)
    assert (plan.metas, plan.host, plan.port, plan.backend, plan.bucket_bytes > 0) == (
        metas,
        "h",
        7,
        "gloo",
        True,
    )
    source.backend = "mpi"
    with pytest.raises(InvalidArgument, match=r"broadcast\.backend"):
        wire.broadcast_from_proto(source)


def test_trace_context_round_trips_and_empty_is_empty() -> None:
    carrier = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "k=v"}
    assert wire.trace_from_proto(wire.trace_to_proto(carrier)) == carrier
    assert wire.trace_to_proto({}) == common_pb2.TraceContext()
    assert wire.trace_from_proto(common_pb2.TraceContext()) == {}


CONVERSIONS = re.compile(
    r"FromString\(|json_format|struct_pb2|FINISH_REASON_|\b(ChatMessage|ScoredGroup|ScoredSample|Reward|"
    r"ScoreItem|ItemScore|NamedScorer|WeightedScorer|GeneratedSample|TensorSpec|TraceContext|"
    r"ScorerDescription)\("
)


def test_no_proto_conversion_outside_the_wire_module() -> None:
    """Building or parsing the contract's data messages happens in `contracts/wire/` only."""
    wire_package = SRC / "contracts" / "wire"
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path.parent != wire_package and "v1" not in path.relative_to(SRC).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CONVERSIONS.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_wire_module_imports_no_torch_no_scorer_and_no_server() -> None:
    code = (
        "import sys, rlfabric.contracts.wire\n"
        "bad = ('torch', 'rlfabric.reward.scorers', 'rlfabric.reward.service', 'rlfabric.reward.pool',\n"
        "       'rlfabric.runtime.grpc_server', 'rlfabric.rollout.engine', 'rlfabric.learner.batch')\n"
        "print(sorted(m for m in sys.modules if m.startswith(bad)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
