"""The RewardService gRPC adapter: proto -> domain, call `RewardEngine`, domain -> proto.

Request validation lives here (it is about the wire format): an empty batch, an item without a
completion, an unknown scorer or bad parameters answer INVALID_ARGUMENT; a batch or item over the size
limits answers RESOURCE_EXHAUSTED. Scorer faults are per-item statuses, never RPC errors.

For cheap scorers this adapter, not the scoring, is most of the server's CPU per item, so the per-item
conversions are kept to plain field reads and writes: a request's scorer spec is converted once per
distinct spec (`SpecCache`), item sizes are checked one by one only when the whole request could hold an
oversized item, and results are written into the response in place.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from rlfabric.reward.pool import KILL_SLACK_S
from rlfabric.reward.scorers import InvalidScorerSpec, ScoreInput, describe_scorers
from rlfabric.reward.service import RewardEngine, ScoredBatch, ScorerSpec
from rlfabric.runtime.errors import InvalidArgument, ResourceExhausted
from rlfabric.runtime.grpc_server import check_bearer
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc

STATUS = {
    "ok": common_pb2.REWARD_STATUS_OK,
    "scorer_error": common_pb2.REWARD_STATUS_SCORER_ERROR,
    "timeout": common_pb2.REWARD_STATUS_TIMEOUT,
}
# Used when the client sets no deadline: a batch may not hold the server forever.
DEFAULT_BATCH_TIMEOUT_S = 300.0
# Kept back from the caller's deadline: a stuck worker is killed up to KILL_SLACK_S after the batch's
# timeout, and the TIMEOUT results must still reach the caller before its deadline (past it the caller
# sees DEADLINE_EXCEEDED and learns nothing about which items timed out).
REPLY_MARGIN_S = KILL_SLACK_S + 0.5
# Distinct scorer specs whose conversion is remembered (a training run sends one spec, over and over).
SPEC_CACHE_SIZE = 256


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Score and ListScorers. With a `token`, both answer UNAUTHENTICATED unless the call carries
    `authorization: Bearer <token>`, checked before anything in the request is read (health and
    reflection are other services and stay open); `token=None` accepts every call."""

    def __init__(
        self, engine: RewardEngine, *, max_batch_items: int, max_item_bytes: int, token: str | None = None
    ) -> None:
        self.engine = engine
        self.max_batch_items = max_batch_items
        self.max_item_bytes = max_item_bytes
        self.token = token
        self.specs = SpecCache(SPEC_CACHE_SIZE)

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        check_bearer(context, self.token)
        self.check_sizes(request)
        spec = self.specs.get(request.scorer)
        items = [item_from_proto(i, item) for i, item in enumerate(request.items)]
        remaining = context.time_remaining()
        timeout = DEFAULT_BATCH_TIMEOUT_S if remaining is None else batch_timeout(remaining)
        try:
            scored = await self.engine.score(
                spec, items, timeout_s=timeout, item_timeout_s=request.item_timeout_seconds or None
            )
        except InvalidScorerSpec as exc:
            raise InvalidArgument(f"scorer.{exc}") from exc
        return response_from(items, scored)

    async def ListScorers(
        self, request: reward_pb2.ListScorersRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListScorersResponse:
        check_bearer(context, self.token)
        return reward_pb2.ListScorersResponse(scorers=[describe(info) for info in describe_scorers()])

    def check_sizes(self, request: reward_pb2.ScoreRequest) -> None:
        if not request.items:
            raise InvalidArgument("items: the batch is empty")
        if len(request.items) > self.max_batch_items:
            raise ResourceExhausted(
                f"items: {len(request.items)} items exceed the limit of {self.max_batch_items}"
            )
        if request.ByteSize() <= self.max_item_bytes:
            return  # no item can be larger than the whole request
        for i, item in enumerate(request.items):
            size = item.ByteSize()
            if size > self.max_item_bytes:
                raise ResourceExhausted(
                    f"items[{i}]: {size} bytes exceed the per-item limit of {self.max_item_bytes}"
                )


def batch_timeout(remaining_s: float) -> float:
    """The scoring budget of a call with `remaining_s` before its deadline: the deadline less the reply
    margin, and never less than half of what is left."""
    return max(remaining_s - REPLY_MARGIN_S, remaining_s / 2, 0.001)


class SpecCache:
    """`spec_from_proto` remembered by the spec's serialized bytes (least recently used dropped first).

    Returning the same `ScorerSpec` object for the same spec also keeps its cache key computed once.
    A spec that fails to convert is not remembered: it raises every time.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._specs: OrderedDict[bytes, ScorerSpec] = OrderedDict()

    def get(self, message: reward_pb2.ScorerSpec) -> ScorerSpec:
        key = message.SerializeToString(deterministic=True)
        spec = self._specs.pop(key, None) or spec_from_proto(message)
        self._specs[key] = spec
        if len(self._specs) > self.size:
            self._specs.popitem(last=False)
        return spec


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
        item.id or str(index),
        prompt_from_proto(item.prompt),
        item.completion,
        item.reference,
        metadata_from_proto(item),
    )


def metadata_from_proto(item: reward_pb2.ScoreItem) -> dict[str, Any]:
    """The item's metadata columns; {} when unset or empty (without a conversion)."""
    if not item.HasField("metadata") or not item.metadata.fields:
        return {}
    return json_format.MessageToDict(item.metadata)


def prompt_from_proto(prompt: common_pb2.Prompt) -> str | list[dict[str, Any]]:
    kind = prompt.WhichOneof("kind")
    if kind == "messages":
        return [{"role": m.role, "content": m.content} for m in prompt.messages.messages]
    if kind == "token_ids":
        raise InvalidArgument("prompt.token_ids: the reward service scores text; send text or messages")
    return prompt.text


def response_from(items: Sequence[ScoreInput], scored: ScoredBatch) -> reward_pb2.ScoreResponse:
    """The response for `items` and their results, written field by field into messages the response
    owns (cheaper than building messages and copying them in)."""
    response = reward_pb2.ScoreResponse()
    add = response.results.add
    name, version, latency = scored.scorer_name, scored.scorer_version, scored.latency_s
    for item, result in zip(items, scored.results, strict=True):
        out = add()
        out.id = item.id
        reward = out.reward
        reward.value = result.reward  # NaN unless OK: a failure must never read as a reward of 0
        reward.status = STATUS[result.status]
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
