"""Python clients of the reward service: `RewardClient` (blocking) and `AsyncRewardClient` (asyncio).

    with RewardClient("127.0.0.1:50052", token=os.environ["RLFABRIC_REWARD_TOKEN"]) as client:
        results = client.score(
            [{"id": "1", "prompt": "2+2?", "completion": "\\boxed{4}", "reference": "4"}], "math_verify"
        )
        assert results[0].status == "ok"

`scorer` is a registered name, a `ScorerSpec`, or a mapping in the run file's `[reward]` form
({"scorer": "composite", "parts": [...]}). Items are `ScoreInput`s or mappings with the JSONL columns
(`id`, `prompt`, `completion`, `reference`, anything else becomes metadata). `token` is the service's
bearer token (its `token` setting), sent as `authorization: Bearer <token>` on every call; a service that
requires one answers UNAUTHENTICATED without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from rlfabric.reward.scorers import ScoreInput
from rlfabric.reward.service import ScorerSpec, spec_from_reward_spec
from rlfabric.runspec import RewardSpec
from rlfabric.runtime.grpc_client import make_channel
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc

STATUS_NAMES = {
    common_pb2.REWARD_STATUS_OK: "ok",
    common_pb2.REWARD_STATUS_SCORER_ERROR: "scorer_error",
    common_pb2.REWARD_STATUS_TIMEOUT: "timeout",
}
ITEM_COLUMNS = ("id", "prompt", "completion", "reference")


@dataclass(frozen=True)
class ItemResult:
    """One scored item. `reward` is NaN unless `status` is "ok"."""

    id: str
    reward: float
    status: str
    message: str
    components: dict[str, float]
    scorer_name: str
    scorer_version: str
    latency_s: float


def to_spec(
    scorer: str | ScorerSpec | Mapping[str, Any], params: Mapping[str, Any] | None = None
) -> ScorerSpec:
    if isinstance(scorer, ScorerSpec):
        return scorer
    if isinstance(scorer, str):
        return ScorerSpec(scorer, dict(params or {}))
    return spec_from_reward_spec(RewardSpec.model_validate(dict(scorer)))


def to_input(item: ScoreInput | Mapping[str, Any], index: int) -> ScoreInput:
    if isinstance(item, ScoreInput):
        return item
    metadata = {k: v for k, v in item.items() if k not in ITEM_COLUMNS}
    return ScoreInput(
        id=str(item.get("id", index)),
        prompt=item.get("prompt") or "",
        completion=item["completion"],
        reference=str(item.get("reference") or ""),
        metadata=metadata,
    )


def struct(data: Mapping[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(dict(data))
    return message


def spec_to_proto(spec: ScorerSpec) -> reward_pb2.ScorerSpec:
    if spec.name != "composite":
        return reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name=spec.name, params=struct(spec.params)))
    parts = [
        reward_pb2.WeightedScorer(
            scorer=reward_pb2.NamedScorer(name=p["scorer"], params=struct(p.get("params", {}))),
            weight=p.get("weight", 1.0),
            alias=p.get("alias", ""),
        )
        for p in spec.params.get("parts", [])
    ]
    return reward_pb2.ScorerSpec(composite=reward_pb2.CompositeScorer(parts=parts))


def prompt_to_proto(prompt: str | list[dict[str, Any]]) -> common_pb2.Prompt:
    if isinstance(prompt, str):
        return common_pb2.Prompt(text=prompt)
    messages = [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
    return common_pb2.Prompt(messages=common_pb2.ChatMessages(messages=messages))


def build_request(
    items: Sequence[ScoreInput | Mapping[str, Any]], spec: ScorerSpec, item_timeout_s: float | None
) -> reward_pb2.ScoreRequest:
    inputs = [to_input(item, i) for i, item in enumerate(items)]
    return reward_pb2.ScoreRequest(
        items=[
            reward_pb2.ScoreItem(
                id=x.id,
                prompt=prompt_to_proto(x.prompt),
                completion=x.completion,
                reference=x.reference,
                metadata=struct(x.metadata) if x.metadata else None,
            )
            for x in inputs
        ],
        scorer=spec_to_proto(spec),
        item_timeout_seconds=item_timeout_s or 0.0,
    )


def from_proto(result: reward_pb2.ItemScore) -> ItemResult:
    status = STATUS_NAMES.get(result.reward.status, "scorer_error")
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


def describe(response: reward_pb2.ListScorersResponse) -> list[dict[str, Any]]:
    return [json_format.MessageToDict(s, preserving_proto_field_name=True) for s in response.scorers]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class RewardClient:
    """Blocking client. `timeout_s` is the deadline of each call; `token` is sent on each call."""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 60.0,
        max_message_bytes: int = 64 << 20,
        token: str | None = None,
    ) -> None:
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self.channel = grpc.insecure_channel(target, options=options)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = bearer_metadata(token)

    def score(
        self,
        items: Sequence[ScoreInput | Mapping[str, Any]],
        scorer: str | ScorerSpec | Mapping[str, Any],
        params: Mapping[str, Any] | None = None,
        *,
        item_timeout_s: float | None = None,
    ) -> list[ItemResult]:
        request = build_request(items, to_spec(scorer, params), item_timeout_s)
        response = self.stub.Score(request, timeout=self.timeout_s, metadata=self.metadata)
        return [from_proto(r) for r in response.results]

    def list_scorers(self) -> list[dict[str, Any]]:
        request = reward_pb2.ListScorersRequest()
        return describe(self.stub.ListScorers(request, timeout=self.timeout_s, metadata=self.metadata))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRewardClient:
    """asyncio client; create it inside the running event loop. ListScorers is retried on UNAVAILABLE
    (idempotent); Score is not retried, because a scorer with side effects (a judge API) may bill twice."""

    def __init__(self, target: str, *, timeout_s: float = 60.0, token: str | None = None) -> None:
        self.channel = make_channel(
            target,
            retry_methods=[("rlfabric.v1.RewardService", "ListScorers")],
            default_timeout_s=timeout_s,
            bearer_token=token,
        )
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)

    async def score(
        self,
        items: Sequence[ScoreInput | Mapping[str, Any]],
        scorer: str | ScorerSpec | Mapping[str, Any],
        params: Mapping[str, Any] | None = None,
        *,
        item_timeout_s: float | None = None,
    ) -> list[ItemResult]:
        request = build_request(items, to_spec(scorer, params), item_timeout_s)
        response = await self.stub.Score(request)
        return [from_proto(r) for r in response.results]

    async def list_scorers(self) -> list[dict[str, Any]]:
        return describe(await self.stub.ListScorers(reward_pb2.ListScorersRequest()))

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
