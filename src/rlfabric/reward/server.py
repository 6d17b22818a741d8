"""The RewardService gRPC adapter: proto -> domain, call `RewardEngine`, domain -> proto (`contracts.wire`).

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

import grpc

from rlfabric.contracts import wire
from rlfabric.reward.pool import KILL_SLACK_S
from rlfabric.reward.scorers import InvalidScorerSpec, describe_scorers
from rlfabric.reward.service import RewardEngine
from rlfabric.reward.spec import ScorerSpec
from rlfabric.runtime import failpoints
from rlfabric.runtime.errors import InvalidArgument, ResourceExhausted
from rlfabric.runtime.grpc_server import check_bearer
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

# Used when the client sets no deadline: a batch may not hold the server forever.
DEFAULT_BATCH_TIMEOUT_S = 300.0
# Kept back from the caller's deadline: a stuck worker is killed up to KILL_SLACK_S after the batch's
# timeout, and the TIMEOUT results must still reach the caller before its deadline (past it the caller
# sees DEADLINE_EXCEEDED and learns nothing about which items timed out).
REPLY_MARGIN_S = KILL_SLACK_S + 0.5
# Distinct scorer specs whose conversion is remembered (a training run sends one spec, over and over).
SPEC_CACHE_SIZE = 256


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Score, ListScorers and CheckScorer. With a `token`, each answers UNAUTHENTICATED unless the call
    carries `authorization: Bearer <token>`, checked before anything in the request is read (health and
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
        failpoints.hit("reward.score")  # the fault tests' kill, or a hang that blocks the event loop
        self.check_sizes(request)
        spec = self.specs.get(request.scorer)
        items = [wire.item_from_proto(i, item) for i, item in enumerate(request.items)]
        remaining = context.time_remaining()
        timeout = DEFAULT_BATCH_TIMEOUT_S if remaining is None else batch_timeout(remaining)
        try:
            scored = await self.engine.score(
                spec, items, timeout_s=timeout, item_timeout_s=request.item_timeout_seconds or None
            )
        except InvalidScorerSpec as exc:
            raise InvalidArgument(f"scorer.{exc}") from exc
        return wire.score_response(items, scored)

    async def ListScorers(
        self, request: reward_pb2.ListScorersRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListScorersResponse:
        check_bearer(context, self.token)
        scorers = [wire.scorer_description_to_proto(info) for info in describe_scorers()]
        return reward_pb2.ListScorersResponse(scorers=scorers)

    async def CheckScorer(
        self, request: reward_pb2.CheckScorerRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.CheckScorerResponse:
        check_bearer(context, self.token)
        return wire.scorer_problems_to_proto(self.engine.check(self.specs.get(request.scorer)))

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
    """`wire.scorer_spec_from_proto` remembered by the spec's serialized bytes (least recently used dropped
    first).

    Returning the same `ScorerSpec` object for the same spec also keeps its cache key computed once.
    A spec that fails to convert is not remembered: it raises every time.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._specs: OrderedDict[bytes, ScorerSpec] = OrderedDict()

    def get(self, message: reward_pb2.ScorerSpec) -> ScorerSpec:
        key = message.SerializeToString(deterministic=True)
        spec = self._specs.pop(key, None) or wire.scorer_spec_from_proto(message)
        self._specs[key] = spec
        if len(self._specs) > self.size:
            self._specs.popitem(last=False)
        return spec
