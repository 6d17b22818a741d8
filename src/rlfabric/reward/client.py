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

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from rlfabric.contracts import wire
from rlfabric.reward.spec import ItemResult, ScoreInput, ScorerProblem, ScorerSpec, spec_from_reward_spec
from rlfabric.runspec import RewardSpec
from rlfabric.runtime.grpc_client import make_channel
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

__all__ = ["AsyncRewardClient", "ItemResult", "RewardClient", "to_input", "to_spec"]

ITEM_COLUMNS = ("id", "prompt", "completion", "reference")


def to_spec(
    scorer: str | ScorerSpec | Mapping[str, Any], params: Mapping[str, Any] | None = None
) -> ScorerSpec:
    """A registered name (+ params), a spec, or a mapping in the run file's `[reward]` form as a spec."""
    if isinstance(scorer, ScorerSpec):
        return scorer
    if isinstance(scorer, str):
        return ScorerSpec(scorer, dict(params or {}))
    return spec_from_reward_spec(RewardSpec.model_validate(dict(scorer)))


def to_input(item: ScoreInput | Mapping[str, Any], index: int) -> ScoreInput:
    """An item, or a mapping of the JSONL columns (anything but `ITEM_COLUMNS` is metadata)."""
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


def build_request(
    items: Sequence[ScoreInput | Mapping[str, Any]], spec: ScorerSpec, item_timeout_s: float | None
) -> reward_pb2.ScoreRequest:
    """The Score request for `items` (each an item or a mapping of columns)."""
    return wire.score_request([to_input(item, i) for i, item in enumerate(items)], spec, item_timeout_s)


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
        return [wire.item_result_from_proto(r) for r in response.results]

    def list_scorers(self) -> list[dict[str, Any]]:
        request = reward_pb2.ListScorersRequest()
        return wire.scorer_descriptions_from_proto(
            self.stub.ListScorers(request, timeout=self.timeout_s, metadata=self.metadata)
        )

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
        return [wire.item_result_from_proto(r) for r in response.results]

    async def list_scorers(self) -> list[dict[str, Any]]:
        return wire.scorer_descriptions_from_proto(
            await self.stub.ListScorers(reward_pb2.ListScorersRequest())
        )

    async def check_scorer(
        self, scorer: str | ScorerSpec | Mapping[str, Any], *, timeout_s: float | None = None
    ) -> list[ScorerProblem]:
        """What the service finds wrong with a scorer spec (CheckScorer; [] when it is valid)."""
        request = reward_pb2.CheckScorerRequest(scorer=wire.scorer_spec_to_proto(to_spec(scorer)))
        return wire.scorer_problems_from_proto(await self.stub.CheckScorer(request, timeout=timeout_s))

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
