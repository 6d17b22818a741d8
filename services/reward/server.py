"""The RewardService gRPC adapter: proto -> domain, call `RewardEngine`, domain -> proto.

Request validation lives here (it is about the wire format): an empty batch, an item without a
completion, an unknown scorer or bad parameters answer INVALID_ARGUMENT; a batch or item over the size
limits answers RESOURCE_EXHAUSTED. Scorer faults are per-item statuses, never RPC errors.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format

from rlfabric.common.errors import InvalidArgument, ResourceExhausted
from rlfabric.reward.scorers import InvalidScorerSpec, ScoreInput, describe_scorers
from rlfabric.reward.service import RewardEngine, ScoredItem, ScorerSpec
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc

STATUS = {
    "ok": common_pb2.REWARD_STATUS_OK,
    "scorer_error": common_pb2.REWARD_STATUS_SCORER_ERROR,
    "timeout": common_pb2.REWARD_STATUS_TIMEOUT,
}
# Used when the client sets no deadline: a batch may not hold the server forever.
DEFAULT_BATCH_TIMEOUT_S = 300.0


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, engine: RewardEngine, *, max_batch_items: int, max_item_bytes: int) -> None:
        self.engine = engine
        self.max_batch_items = max_batch_items
        self.max_item_bytes = max_item_bytes

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        self.check_sizes(request)
        spec = spec_from_proto(request.scorer)
        items = [item_from_proto(i, item) for i, item in enumerate(request.items)]
        remaining = context.time_remaining()
        timeout = DEFAULT_BATCH_TIMEOUT_S if remaining is None else max(remaining - 0.05, 0.001)
        try:
            scored = await self.engine.score(
                spec, items, timeout_s=timeout, item_timeout_s=request.item_timeout_seconds or None
            )
        except InvalidScorerSpec as exc:
            raise InvalidArgument(f"scorer.{exc}") from exc
        response = reward_pb2.ScoreResponse()
        for item, result in zip(items, scored, strict=True):
            fill(response.results.add(), item.id, result)
        return response

    async def ListScorers(
        self, request: reward_pb2.ListScorersRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListScorersResponse:
        return reward_pb2.ListScorersResponse(scorers=[describe(info) for info in describe_scorers()])

    def check_sizes(self, request: reward_pb2.ScoreRequest) -> None:
        if not request.items:
            raise InvalidArgument("items: the batch is empty")
        if len(request.items) > self.max_batch_items:
            raise ResourceExhausted(
                f"items: {len(request.items)} items exceed the limit of {self.max_batch_items}"
            )
        for i, item in enumerate(request.items):
            size = item.ByteSize()
            if size > self.max_item_bytes:
                raise ResourceExhausted(
                    f"items[{i}]: {size} bytes exceed the per-item limit of {self.max_item_bytes}"
                )


def spec_from_proto(spec: reward_pb2.ScorerSpec) -> ScorerSpec:
    kind = spec.WhichOneof("kind")
    if kind == "named":
        if not spec.named.name:
            raise InvalidArgument("scorer.named.name: a scorer name is required")
        return ScorerSpec(spec.named.name, json_format.MessageToDict(spec.named.params))
    if kind == "composite":
        parts = [part_from_proto(i, p) for i, p in enumerate(spec.composite.parts)]
        return ScorerSpec("composite", {"parts": parts})
    raise InvalidArgument("scorer: set either `named` or `composite`")


def part_from_proto(index: int, part: reward_pb2.WeightedScorer) -> dict[str, Any]:
    if not part.scorer.name:
        raise InvalidArgument(f"scorer.composite.parts[{index}].scorer.name: a scorer name is required")
    return {
        "alias": part.alias or part.scorer.name,
        "scorer": part.scorer.name,
        "weight": part.weight,
        "params": json_format.MessageToDict(part.scorer.params),
    }


def item_from_proto(index: int, item: reward_pb2.ScoreItem) -> ScoreInput:
    if not item.HasField("completion"):
        raise InvalidArgument(f"items[{index}].completion: required (an empty string is allowed)")
    return ScoreInput(
        id=item.id or str(index),
        prompt=prompt_from_proto(item.prompt),
        completion=item.completion,
        reference=item.reference,
        metadata=json_format.MessageToDict(item.metadata) if item.metadata.fields else {},
    )


def prompt_from_proto(prompt: common_pb2.Prompt) -> str | list[dict[str, Any]]:
    kind = prompt.WhichOneof("kind")
    if kind == "messages":
        return [{"role": m.role, "content": m.content} for m in prompt.messages.messages]
    if kind == "token_ids":
        raise InvalidArgument("prompt.token_ids: the reward service scores text; send text or messages")
    return prompt.text


def fill(out: reward_pb2.ItemScore, item_id: str, scored: ScoredItem) -> None:
    """Writes one result into `out` in place (cheaper than building and copying messages)."""
    result = scored.result
    out.id = item_id
    out.reward.value = result.reward  # NaN unless OK: a failure must never read as a reward of 0
    out.reward.status = STATUS[result.status]
    if result.message:
        out.reward.message = result.message
    if result.components:
        out.reward.components.update(result.components)
    out.scorer_name = scored.scorer_name
    out.scorer_version = scored.scorer_version
    out.latency_seconds = scored.latency_s


def describe(info: Any) -> reward_pb2.ScorerDescription:
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
