"""The reward clients fail with `RewardServiceError` (a gRPC status code and the field it names), never a
raw gRPC error or a KeyError, and refuse an item that is not text before anything is sent."""

from __future__ import annotations

import socket
from typing import Any

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from rlfabric.reward.client import AsyncRewardClient, RewardClient, RewardServiceError, to_input


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("row", "field", "reason"),
    [
        ({"prompt": "q"}, "items[0].completion", "required"),
        ({"completion": 3}, "items[0].completion", "got int"),
        ({"completion": [{"role": "a", "content": "x"}] * 2}, "items[0].completion", "a list of 2 items"),
        ({"completion": "x", "prompt": 5}, "items[0].prompt", "got int"),
        ({"completion": "x", "completion_ids": [1, -2]}, "items[0].completion_ids", "non-negative"),
        ({"completion": "x", "policy_version": "7"}, "items[0].policy_version", "got str"),
    ],
)
def test_a_bad_item_names_its_field(row: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(RewardServiceError) as err:
        to_input(row, 0)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.field == field and reason in err.value.reason


def test_a_conversational_completion_is_its_assistant_message() -> None:
    row = {"completion": [{"role": "assistant", "content": "4"}], "completion_ids": [7], "solution": "4"}
    item = to_input(row, 3)
    assert (item.id, item.completion, item.completion_ids, item.metadata) == (
        "3",
        "4",
        [7],
        {"solution": "4"},
    )


def test_a_service_refusal_keeps_the_code_and_the_field() -> None:
    details = "scorer.name: unknown scorer 'nope'"
    error = RewardServiceError.from_rpc(
        AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, Metadata(), Metadata(), details=details)
    )
    assert (error.code, error.field, error.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "scorer.name",
        details,
    )
    assert str(error) == f"INVALID_ARGUMENT: {details}"


def test_an_unreachable_service_is_a_typed_error() -> None:
    with RewardClient(closed_port(), timeout_s=2) as client, pytest.raises(RewardServiceError) as err:
        client.score([{"completion": "x"}], "exact_match")
    assert err.value.code is grpc.StatusCode.UNAVAILABLE


async def test_the_async_client_raises_the_same_errors() -> None:
    async with AsyncRewardClient(closed_port(), timeout_s=2) as client:
        with pytest.raises(RewardServiceError) as err:
            await client.score([{"completion": "x"}], "exact_match")
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(RewardServiceError) as bad:
            await client.score([{"prompt": "no completion"}], "exact_match")
        assert bad.value.field == "items[0].completion"
