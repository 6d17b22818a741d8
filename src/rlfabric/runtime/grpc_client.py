"""Client channels to rlfabric services, configured the same way everywhere.

`make_channel` sets explicit message-size limits and keepalive (matching `GrpcServerOptions`), TLS or
mTLS, a retry policy for the methods the caller declares idempotent (only UNAVAILABLE is retried, up to 4
attempts with jittered exponential backoff; gRPC retries below the interceptors, so a retried call keeps
its deadline), and client interceptors that give every call a default deadline when the caller set none,
attach a bearer token, and make it in a CLIENT span (`telemetry.rpc_span`, with `server.address`/`port`
and `rpc.grpc.status_code`; the span ends when the call does, a stream's last message included) whose
trace context goes with the metadata. Health checks are not traced, as the servers do not trace them.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from rlfabric.runtime import telemetry

MIB = 1 << 20
RETRY_MAX_ATTEMPTS = 4
RETRY_INITIAL_BACKOFF_S = 0.1
RETRY_MAX_BACKOFF_S = 2.0
RETRY_BACKOFF_MULTIPLIER = 2.0

RetryMethod = str | tuple[str, str]
"""An idempotent method: "pkg.Service" (all its methods), "pkg.Service/Method", or (service, method)."""


@dataclass(frozen=True)
class ClientTls:
    """PEM files for a TLS client. `cert_file` + `key_file` present a client certificate (mTLS)."""

    root_ca_file: str | None = None
    """CA that signed the server's certificate; None uses the system roots."""
    cert_file: str | None = None
    key_file: str | None = None
    server_name_override: str | None = None
    """Name to verify the server certificate against instead of the target's host (tests, IP targets)."""

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials read from the files now. A certificate without its key (or vice versa) is an error."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("ClientTls needs both cert_file and key_file, or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def _read(path: str | None) -> bytes | None:
    """The bytes of a file, or None for no path."""
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def retry_service_config(retry_methods: Sequence[RetryMethod]) -> str:
    """The service-config JSON retrying UNAVAILABLE on exactly `retry_methods`; "" when there are none."""
    if not retry_methods:
        return ""
    policy = {
        "maxAttempts": RETRY_MAX_ATTEMPTS,
        "initialBackoff": f"{RETRY_INITIAL_BACKOFF_S}s",
        "maxBackoff": f"{RETRY_MAX_BACKOFF_S}s",
        "backoffMultiplier": RETRY_BACKOFF_MULTIPLIER,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    names = [_method_name(m) for m in retry_methods]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def _method_name(method: RetryMethod) -> dict[str, str]:
    """The service-config `name` entry for one RetryMethod."""
    if isinstance(method, tuple):
        service, name = method
    else:
        service, _, name = method.strip("/").partition("/")
    if not service or "." not in service:
        raise ValueError(f"retry method {method!r}: the service must be fully qualified, e.g. 'pkg.Service'")
    return {"service": service, "method": name} if name else {"service": service}


def client_channel_options(
    max_message_bytes: int, retry_methods: Sequence[RetryMethod], tls: ClientTls | None
) -> list[tuple[str, Any]]:
    """Core channel arguments: size limits, keepalive that a default server accepts, retries."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Without this, gRPC core (1.85) gave a keepalive ping its default ping timeout (60 s) rather than
        # keepalive_timeout_ms: a silent peer took ~90 s to detect instead of 30 s + 10 s.
        ("grpc.http2.ping_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.service_config_disable_resolution", 1),
    ]
    service_config = retry_service_config(retry_methods)
    if service_config:
        options.append(("grpc.service_config", service_config))
    if tls is not None and tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return options


UNTRACED_PREFIX = f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/"
_ending: set[asyncio.Task[None]] = set()
"""Tasks ending client spans, held until done (the loop keeps only weak references to tasks)."""


class _CallDefaults:
    """Fills in what every outgoing call should carry: a deadline, a bearer token, the trace context."""

    def __init__(self, target: str, default_timeout_s: float | None, bearer_token: str | None) -> None:
        self.server = telemetry.server_attributes(target)
        self.default_timeout_s = default_timeout_s
        self.bearer_token = bearer_token

    async def traced(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        """Starts the call in a CLIENT span that ends, with the call's status code, when the call does."""
        method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
        if method.startswith(UNTRACED_PREFIX):
            return await continuation(self.apply(details), request)
        name, attributes = telemetry.rpc_span(method)
        span = telemetry.start_span(name, kind=SpanKind.CLIENT, attributes={**attributes, **self.server})
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False):
                call = await continuation(self.apply(details), request)
        except BaseException as exc:
            span.record_exception(exc)
            span.end()
            raise
        if span.is_recording():
            call.add_done_callback(functools.partial(_end_when_done, span))
        return call

    def apply(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        """`details` with the default timeout (only if the caller gave none) and the extra metadata."""
        pairs: list[tuple[str, str]] = [(k, v) for k, v in details.metadata or () if isinstance(v, str)]
        binary = [(k, v) for k, v in details.metadata or () if not isinstance(v, str)]
        if self.bearer_token:
            pairs.append(("authorization", f"Bearer {self.bearer_token}"))
        telemetry.inject_metadata(pairs)
        timeout = details.timeout if details.timeout is not None else self.default_timeout_s
        return grpc.aio.ClientCallDetails(  # type: ignore[call-arg]
            details.method,
            timeout,
            grpc.aio.Metadata(*pairs, *binary),
            details.credentials,
            details.wait_for_ready,
        )


def _end_when_done(span: trace.Span, call: grpc.aio.Call) -> None:
    """A done callback: ends `span` with the call's status code (read in a task: `code()` is async)."""
    task = asyncio.ensure_future(_end_span(span, call))
    _ending.add(task)
    task.add_done_callback(_ending.discard)


async def _end_span(span: trace.Span, call: grpc.aio.Call) -> None:
    try:
        code = await call.code()
        span.set_attribute(telemetry.RPC_GRPC_STATUS_CODE, code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(trace.StatusCode.ERROR, code.name)
    finally:
        span.end()


class _UnaryUnary(_CallDefaults, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self.traced(continuation, client_call_details, request)


class _UnaryStream(_CallDefaults, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self.traced(continuation, client_call_details, request)


class _StreamUnary(_CallDefaults, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self.traced(continuation, client_call_details, request_iterator)


class _StreamStream(_CallDefaults, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self.traced(continuation, client_call_details, request_iterator)


def make_channel(
    target: str,
    *,
    tls: ClientTls | None = None,
    max_message_bytes: int = 64 * MIB,
    retry_methods: Sequence[RetryMethod] = (),
    default_timeout_s: float | None = None,
    bearer_token: str | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `target` ("host:port"); must be created inside the running event loop.

    `retry_methods` are the idempotent methods retried on UNAVAILABLE; nothing else is retried.
    `default_timeout_s` becomes the deadline of every call (streams included) made without a `timeout=`.
    `bearer_token`, when set, is sent as `authorization: Bearer <token>` (checked by `check_bearer`).
    """
    options = client_channel_options(max_message_bytes, retry_methods, tls)
    interceptors: list[Any] = [
        cls(target, default_timeout_s, bearer_token)
        for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    ]
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        target, tls.channel_credentials(), options=options, interceptors=interceptors
    )


async def wait_ready(channel: grpc.aio.Channel, timeout_s: float) -> None:
    """Waits until `channel` is connected; raises TimeoutError after `timeout_s`."""
    await asyncio.wait_for(channel.channel_ready(), timeout_s)


async def health_check(
    target: str | grpc.aio.Channel, service: str = "", *, tls: ClientTls | None = None, timeout_s: float = 5.0
) -> str:
    """The health status name ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN") of `service` ("" = server).

    `target` is an address (a channel is opened and closed here) or an existing channel. A server that
    cannot be reached raises `grpc.aio.AioRpcError` (UNAVAILABLE or DEADLINE_EXCEEDED).
    """
    if not isinstance(target, str):
        return await _check(target, service, timeout_s)
    async with make_channel(target, tls=tls) as channel:
        return await _check(channel, service, timeout_s)


async def _check(channel: grpc.aio.Channel, service: str, timeout_s: float) -> str:
    """One Health.Check call; NOT_FOUND (a service the server does not know) is SERVICE_UNKNOWN."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        raise
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
