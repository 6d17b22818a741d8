"""Domain errors that carry the gRPC status code they become at the service boundary.

Domain code raises these (it never imports grpc to build a status by hand); the server interceptor in
`rlfabric.runtime.grpc_server` is the one place that turns a raised `ServiceError` into
`context.abort(error.code, str(error))`. Any other exception escaping a servicer becomes INTERNAL.
Each subclass fixes its code at class level, so `raise InvalidArgument("unknown scorer 'x'")` is all a
caller writes.
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class ServiceError(Exception):
    """An error whose message is safe to show to the caller, answered with status `code`.

    Invariant: `code` is never OK; the message is the status details, sent verbatim to the client.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    @property
    def message(self) -> str:
        """The status details sent to the client."""
        return str(self)


class InvalidArgument(ServiceError):
    """The request itself is wrong (unknown name, bad parameter); retrying it unchanged cannot help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    """The request names something (a run, a checkpoint, a scorer version) that does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    """The system is not in a state where the request can run (e.g. weights not loaded yet)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    """A limit was hit (batch size, queue depth, concurrency); the caller should back off."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(ServiceError):
    """The call carries no credentials, or the wrong ones."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(ServiceError):
    """A transient failure (draining, a dependency down); safe to retry for idempotent methods."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """Work did not finish within its own deadline (distinct from the RPC deadline, which gRPC enforces)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
