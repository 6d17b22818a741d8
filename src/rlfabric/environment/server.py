"""The EnvironmentService gRPC adapter: proto -> domain, call `SessionTable`, domain -> proto
(`contracts.wire`).

Request validation about the wire format lives here (a missing session id, an oversized action, a task
that is not an object); the session table raises the domain errors (NOT_FOUND, RESOURCE_EXHAUSTED,
FAILED_PRECONDITION) that the server interceptor maps to status codes. Environment faults are statuses
in the reply, never RPC errors.
"""

from __future__ import annotations

import grpc

from rlfabric.contracts import wire
from rlfabric.environment.sessions import SessionTable
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.runtime.grpc_server import check_bearer
from rlfabric.v1 import environment_pb2, environment_pb2_grpc


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """Reset, Step and Close. With a `token`, each answers UNAUTHENTICATED unless the call carries
    `authorization: Bearer <token>`, checked before the request is read; `token=None` accepts all."""

    def __init__(self, table: SessionTable, *, max_action_bytes: int, token: str | None = None) -> None:
        self.table = table
        self.max_action_bytes = max_action_bytes
        self.token = token

    async def Reset(
        self, request: environment_pb2.ResetRequest, context: grpc.aio.ServicerContext
    ) -> environment_pb2.ResetReply:
        check_bearer(context, self.token)
        task = wire.task_from_proto(request)
        seed = request.seed if request.HasField("seed") else None
        outcome = await self.table.reset(task, seed, request.session_ttl_seconds or None)
        return wire.reset_reply(outcome)

    async def Step(
        self, request: environment_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> environment_pb2.StepReply:
        check_bearer(context, self.token)
        require_session_id(request.session_id)
        size = len(request.action.encode())
        if size > self.max_action_bytes:
            raise InvalidArgument(f"action: {size} bytes exceed the limit of {self.max_action_bytes}")
        return wire.step_reply(await self.table.step(request.session_id, request.action))

    async def Close(
        self, request: environment_pb2.CloseRequest, context: grpc.aio.ServicerContext
    ) -> environment_pb2.CloseReply:
        check_bearer(context, self.token)
        require_session_id(request.session_id)
        await self.table.close(request.session_id)
        return environment_pb2.CloseReply()


def require_session_id(session_id: str) -> None:
    """INVALID_ARGUMENT for an empty session id."""
    if not session_id:
        raise InvalidArgument("session_id: required (the id Reset returned)")
