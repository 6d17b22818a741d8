"""The reward contract's conversions: scorer specs (named and composite), scorer checks and descriptions,
score items and results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from rlfabric.contracts.wire.common import (
    REWARD_STATUS,
    prompt_to_proto,
    reward_status_from_proto,
    struct_from_proto,
    struct_to_proto,
    text_prompt_from_proto,
)
from rlfabric.reward.spec import (
    COMPOSITE,
    ItemResult,
    ScoredBatch,
    ScoreInput,
    ScorerInfo,
    ScorerProblem,
    ScorerSpec,
    composite_part,
)
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.v1 import common_pb2, reward_pb2


def scorer_spec_to_proto(spec: ScorerSpec) -> reward_pb2.ScorerSpec:
    """A named spec, or a composite of its `parts` (weight 1 and no alias unless given)."""
    if spec.name != COMPOSITE:
        return reward_pb2.ScorerSpec(named=named_to_proto(spec.name, spec.params))
    parts = [part_to_proto(p) for p in spec.params.get("parts", [])]
    return reward_pb2.ScorerSpec(composite=reward_pb2.CompositeScorer(parts=parts))


def named_to_proto(name: str, params: Mapping[str, Any]) -> reward_pb2.NamedScorer:
    """One scorer with its parameters."""
    return reward_pb2.NamedScorer(name=name, params=struct_to_proto(params))


def part_to_proto(part: Mapping[str, Any]) -> reward_pb2.WeightedScorer:
    """One `composite_part` dict (or a run file's part) as a `WeightedScorer`."""
    return reward_pb2.WeightedScorer(
        scorer=named_to_proto(part["scorer"], part.get("params", {})),
        weight=part.get("weight", 1.0),
        alias=part.get("alias") or "",
    )


def scorer_spec_from_proto(spec: reward_pb2.ScorerSpec) -> ScorerSpec:
    """The spec a request names; InvalidArgument naming the field when it names none."""
    kind = spec.WhichOneof("kind")
    if kind == "named":
        if not spec.named.name:
            raise InvalidArgument("scorer.named.name: a scorer name is required")
        return ScorerSpec(spec.named.name, struct_from_proto(spec.named.params))
    if kind == "composite":
        parts = [part_from_proto(i, p) for i, p in enumerate(spec.composite.parts)]
        return ScorerSpec(COMPOSITE, {"parts": parts})
    raise InvalidArgument("scorer: set either `named` or `composite`")


def part_from_proto(index: int, part: reward_pb2.WeightedScorer) -> dict[str, Any]:
    """Part `index` of a composite as a `composite_part` dict."""
    if not part.scorer.name:
        raise InvalidArgument(f"scorer.composite.parts[{index}].scorer.name: a scorer name is required")
    return composite_part(part.scorer.name, struct_from_proto(part.scorer.params), part.weight, part.alias)


def scorer_problems_to_proto(problems: Iterable[ScorerProblem]) -> reward_pb2.CheckScorerResponse:
    """CheckScorer's answer: the spec's problems (none: valid)."""
    return reward_pb2.CheckScorerResponse(
        problems=[reward_pb2.ScorerProblem(field=p.field, reason=p.reason) for p in problems]
    )


def scorer_problems_from_proto(response: reward_pb2.CheckScorerResponse) -> list[ScorerProblem]:
    """The problems of a CheckScorer answer, in its order."""
    return [ScorerProblem(p.field, p.reason) for p in response.problems]


def scorer_description_to_proto(info: ScorerInfo) -> reward_pb2.ScorerDescription:
    """A registered scorer as ListScorers describes it (a required parameter has no default)."""
    return reward_pb2.ScorerDescription(
        name=info.name,
        version=info.version,
        description=info.description,
        params=[
            reward_pb2.ScorerParam(
                name=p.name,
                type=p.type,
                default_json=p.default or "",
                description=p.description,
                required=p.required,
            )
            for p in info.params
        ],
    )


def scorer_descriptions_from_proto(response: reward_pb2.ListScorersResponse) -> list[dict[str, Any]]:
    """ListScorers' answer as JSON-ready dicts, with the proto field names."""
    return [json_format.MessageToDict(s, preserving_proto_field_name=True) for s in response.scorers]


def score_request(
    items: Sequence[ScoreInput], spec: ScorerSpec, item_timeout_s: float | None
) -> reward_pb2.ScoreRequest:
    """One Score call; `item_timeout_s` None leaves the server's default."""
    return reward_pb2.ScoreRequest(
        items=[item_to_proto(x) for x in items],
        scorer=scorer_spec_to_proto(spec),
        item_timeout_seconds=item_timeout_s or 0.0,
    )


def item_to_proto(item: ScoreInput) -> reward_pb2.ScoreItem:
    """One item; metadata is left unset when empty."""
    return reward_pb2.ScoreItem(
        id=item.id,
        prompt=prompt_to_proto(item.prompt),
        completion=item.completion,
        reference=item.reference,
        metadata=struct_to_proto(item.metadata) if item.metadata else None,
        completion_ids=None if item.completion_ids is None else common_pb2.TokenIds(ids=item.completion_ids),
        policy_version=item.policy_version,
        epoch=item.epoch,
    )


def item_from_proto(index: int, item: reward_pb2.ScoreItem) -> ScoreInput:
    """Item `index` of a request; its id defaults to the index. InvalidArgument without a completion."""
    if not item.HasField("completion"):
        raise InvalidArgument(f"items[{index}].completion: required (an empty string is allowed)")
    return ScoreInput(
        item.id or str(index),
        text_prompt_from_proto(item.prompt),
        item.completion,
        item.reference,
        metadata_from_proto(item),
        list(item.completion_ids.ids) if item.HasField("completion_ids") else None,
        item.policy_version if item.HasField("policy_version") else None,
        item.epoch if item.HasField("epoch") else None,
    )


def metadata_from_proto(item: reward_pb2.ScoreItem) -> dict[str, Any]:
    """The item's metadata columns; {} when unset or empty (without a conversion)."""
    if not item.HasField("metadata") or not item.metadata.fields:
        return {}
    return struct_from_proto(item.metadata)


def score_response(items: Sequence[ScoreInput], scored: ScoredBatch) -> reward_pb2.ScoreResponse:
    """The response for `items` and their results, written field by field into messages the response
    owns (for cheap scorers this conversion is most of the server's CPU per item)."""
    response = reward_pb2.ScoreResponse()
    add = response.results.add
    name, version, latency = scored.scorer_name, scored.scorer_version, scored.latency_s
    for item, result in zip(items, scored.results, strict=True):
        out = add()
        out.id = item.id
        reward = out.reward
        reward.value = result.reward  # NaN unless OK: a failure must never read as a reward of 0
        reward.status = REWARD_STATUS[result.status]
        if result.message:
            reward.message = result.message
        if result.components:
            components = reward.components
            for key, value in result.components.items():
                components[key] = value
        out.scorer_name = name
        out.scorer_version = version
        out.latency_seconds = latency
    return response


def item_result_from_proto(result: reward_pb2.ItemScore) -> ItemResult:
    """One received score; the reward is NaN unless the status is "ok", whatever the value says."""
    status = reward_status_from_proto(result.reward.status)
    return ItemResult(
        id=result.id,
        reward=result.reward.value if status == "ok" else math.nan,
        status=status,
        message=result.reward.message,
        components=dict(result.reward.components),
        scorer_name=result.scorer_name,
        scorer_version=result.scorer_version,
        latency_s=result.latency_seconds,
    )
