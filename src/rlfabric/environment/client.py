"""The async client of the environment service, for whoever drives trajectories.

    async with AsyncEnvironmentClient("127.0.0.1:50054", token=token) as client:
        reset = await client.reset({"prompt": "What is 6 * 7?"})
        if reset.status == "ok":
            step = await client.step(reset.session_id, completion_text)
            ...
            await client.close(reset.session_id)

`reset` and `step` answer the service's outcomes (`ResetOutcome`, `StepOutcome`): an environment that
failed or timed out is a status there, not an exception. A call the service refuses raises
`EnvironmentServiceError` with the gRPC status code: NOT_FOUND for an unknown or expired session,
RESOURCE_EXHAUSTED at the session limit, FAILED_PRECONDITION for a session that is done,
INVALID_ARGUMENT for bad input, UNAUTHENTICATED without the token. Nothing is retried: a Reset or Step
repeated after a lost answer would open a second session or apply the action twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc

from rlfabric.contracts import wire
from rlfabric.environment.types import ResetOutcome, StepOutcome
from rlfabric.runtime.grpc_client import make_channel
from rlfabric.v1 import environment_pb2, environment_pb2_grpc

__all__ = ["AsyncEnvironmentClient", "EnvironmentServiceError"]


class EnvironmentServiceError(Exception):
    """A call the environment service refused; `code` is the gRPC status code, `details` its words."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


@contextmanager
def rpc_errors() -> Iterator[None]:
    """Turns a failed gRPC call inside into an `EnvironmentServiceError`."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise EnvironmentServiceError(exc.code(), exc.details() or "") from None


class AsyncEnvironmentClient:
    """asyncio client; create it inside the running event loop. `timeout_s` is each call's deadline
    (keep it above the service's step_timeout_s, so a slow step answers TIMEOUT rather than the call
    expiring); `token` is sent on every call."""

    def __init__(self, target: str, *, timeout_s: float = 60.0, token: str | None = None) -> None:
        self.channel = make_channel(target, default_timeout_s=timeout_s, bearer_token=token)
        self.stub = environment_pb2_grpc.EnvironmentServiceStub(self.channel)

    async def reset(
        self, task: Mapping[str, Any], *, seed: int | None = None, session_ttl_s: float | None = None
    ) -> ResetOutcome:
        """Opens a session on `task` (a dataset row): its id, first messages and tools, or the status
        saying why the environment could not start."""
        with rpc_errors():
            reply = await self.stub.Reset(wire.reset_request(task, seed, session_ttl_s))
        return wire.reset_outcome_from_proto(reply)

    async def step(self, session_id: str, action: str) -> StepOutcome:
        """Sends the model's turn; the environment's answer or the status that replaced it."""
        with rpc_errors():
            reply = await self.stub.Step(wire.step_request(session_id, action))
        return wire.step_outcome_from_proto(reply)

    async def close(self, session_id: str) -> None:
        """Ends the session."""
        with rpc_errors():
            await self.stub.Close(environment_pb2.CloseRequest(session_id=session_id))

    async def aclose(self) -> None:
        """Closes the channel."""
        await self.channel.close(None)

    async def __aenter__(self) -> AsyncEnvironmentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
