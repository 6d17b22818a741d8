"""Python clients of the reward service: `RewardClient` (blocking) and `AsyncRewardClient` (asyncio).

    with RewardClient("127.0.0.1:50052", token=os.environ["RLFABRIC_REWARD_TOKEN"]) as client:
        results = client.score(
            [{"id": "1", "prompt": "2+2?", "completion": "\\boxed{4}", "reference": "4"}], "math_verify"
        )
        assert results[0].status == "ok"

`scorer` is a registered name, a `ScorerSpec`, or a mapping in the run file's `[reward]` form
({"scorer": "composite", "parts": [...]}). Items are `ScoreInput`s or mappings with the JSONL columns
(`id`, `prompt`, `completion`, `reference`, `completion_ids`, `policy_version`, `epoch`; anything else
becomes metadata). A completion is a string, or TRL's conversational form: one assistant message
`[{"role": "assistant", "content": "..."}]`. `token` is the service's bearer token (its `token` setting),
sent as `authorization: Bearer <token>` on every call; a service that requires one answers UNAUTHENTICATED
without it.

A call that fails raises `RewardServiceError` with the gRPC status code: INVALID_ARGUMENT for bad input
(found here before anything is sent, or by the service), naming the field (`items[3].completion`);
UNAUTHENTICATED, UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED as the service answered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

from rlfabric.contracts import wire
from rlfabric.reward.spec import ItemResult, ScoreInput, ScorerProblem, ScorerSpec, spec_from_reward_spec
from rlfabric.runspec import RewardSpec
from rlfabric.runtime.grpc_client import make_channel
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

__all__ = ["AsyncRewardClient", "ItemResult", "RewardClient", "RewardServiceError", "to_input", "to_spec"]

ITEM_COLUMNS = ("id", "prompt", "completion", "reference", "completion_ids", "policy_version", "epoch")
"""The columns of an item mapping that are not metadata."""


class RewardServiceError(Exception):
    """A reward call that failed. `code` is the gRPC status code, `field` the offending field when the
    failure names one ("items[3].completion"; "" otherwise), `reason` what is wrong."""

    def __init__(self, code: grpc.StatusCode, reason: str, field: str = "") -> None:
        self.code, self.reason, self.field = code, reason, field
        super().__init__(f"{code.name}: {self.details}")

    @property
    def details(self) -> str:
        """The failure as the service words it: "field: reason", or the reason."""
        return f"{self.field}: {self.reason}" if self.field else self.reason

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> RewardServiceError:
        """The error of a failed call; an INVALID_ARGUMENT's details start with the field they name."""
        code, details = error.code(), error.details() or ""  # type: ignore[attr-defined]
        field, sep, reason = details.partition(": ")
        if code is grpc.StatusCode.INVALID_ARGUMENT and sep and " " not in field:
            return cls(code, reason, field)
        return cls(code, details)


class BadItem(ValueError):
    """An item column that cannot be sent: `column` names it, `reason` says why."""

    def __init__(self, column: str, reason: str) -> None:
        super().__init__(f"{column}: {reason}")
        self.column, self.reason = column, reason


@contextmanager
def rpc_errors() -> Iterator[None]:
    """Turns a failed gRPC call inside into a `RewardServiceError`."""
    try:
        yield
    except grpc.RpcError as exc:
        raise RewardServiceError.from_rpc(exc) from None


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
    """An item, or a mapping of the JSONL columns (anything but `ITEM_COLUMNS` is metadata);
    `RewardServiceError` (INVALID_ARGUMENT, naming `items[index].<column>`) for a column that is wrong."""
    if isinstance(item, ScoreInput):
        return item
    try:
        return item_from_row(item, index)
    except BadItem as exc:
        raise RewardServiceError(
            grpc.StatusCode.INVALID_ARGUMENT, exc.reason, f"items[{index}].{exc.column}"
        ) from None


def item_from_row(row: Mapping[str, Any], index: int) -> ScoreInput:
    """The item of one mapping of columns; `BadItem` naming the column that is wrong."""
    if not isinstance(row, Mapping):
        raise BadItem("item", f"expected an object of columns, got {type(row).__name__}")
    return ScoreInput(
        id=str(row.get("id", index)),
        prompt=prompt_column(row.get("prompt")),
        completion=completion_column(row),
        reference=str(row.get("reference") or ""),
        metadata={k: v for k, v in row.items() if k not in ITEM_COLUMNS},
        completion_ids=token_ids_column(row.get("completion_ids")),
        policy_version=int_column(row, "policy_version"),
        epoch=int_column(row, "epoch"),
    )


def prompt_column(prompt: Any) -> str | list[dict[str, Any]]:
    """A prompt: text or a list of chat messages (objects with a string `content`); none is ""."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    if isinstance(prompt, list) and all(is_message(m) for m in prompt):
        return prompt
    raise BadItem("prompt", f"expected text or a list of chat messages, got {type(prompt).__name__}")


def completion_column(row: Mapping[str, Any]) -> str:
    """The completion text: a string, or the content of one assistant message (TRL's conversational
    form). Anything else is refused: a completion that is not text must never be scored."""
    if "completion" not in row:
        raise BadItem("completion", "required (an empty string is allowed)")
    completion = row["completion"]
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and len(completion) == 1 and is_message(completion[0]):
        return str(completion[0]["content"])
    shape = (
        f"a list of {len(completion)} items" if isinstance(completion, list) else type(completion).__name__
    )
    raise BadItem(
        "completion", f'expected a string or [{{"role": "assistant", "content": ...}}], got {shape}'
    )


def is_message(message: Any) -> bool:
    return isinstance(message, Mapping) and isinstance(message.get("content"), str)


def token_ids_column(ids: Any) -> list[int] | None:
    """Token ids: a list of non-negative integers, or None when unknown."""
    if ids is None:
        return None
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return ids
    raise BadItem("completion_ids", "expected a list of non-negative integer token ids")


def int_column(row: Mapping[str, Any], column: str) -> int | None:
    value = row.get(column)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise BadItem(column, f"expected an integer, got {type(value).__name__}")


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
        """One result per item, in order; `RewardServiceError` when the call fails."""
        request = build_request(items, to_spec(scorer, params), item_timeout_s)
        with rpc_errors():
            response = self.stub.Score(request, timeout=self.timeout_s, metadata=self.metadata)
        return [wire.item_result_from_proto(r) for r in response.results]

    def list_scorers(self) -> list[dict[str, Any]]:
        request = reward_pb2.ListScorersRequest()
        with rpc_errors():
            response = self.stub.ListScorers(request, timeout=self.timeout_s, metadata=self.metadata)
        return wire.scorer_descriptions_from_proto(response)

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
        """One result per item, in order; `RewardServiceError` when the call fails."""
        request = build_request(items, to_spec(scorer, params), item_timeout_s)
        with rpc_errors():
            response = await self.stub.Score(request)
        return [wire.item_result_from_proto(r) for r in response.results]

    async def list_scorers(self) -> list[dict[str, Any]]:
        with rpc_errors():
            response = await self.stub.ListScorers(reward_pb2.ListScorersRequest())
        return wire.scorer_descriptions_from_proto(response)

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
