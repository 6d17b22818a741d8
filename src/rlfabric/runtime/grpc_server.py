"""The async gRPC server every rlfabric service runs, with the same plumbing everywhere.

`GrpcServer` wraps `grpc.aio.server` and always adds:
    - the standard health service (`grpc.health.v1.Health`), with a status per service and overall ("");
    - server reflection (grpcurl and friends can list and call the services without the .proto files);
    - explicit message-size and keepalive limits (`GrpcServerOptions`), optional TLS or mTLS;
    - `RpcInterceptor`: the one place where
        * load past `max_concurrent_rpcs` in-flight RPCs is shed with RESOURCE_EXHAUSTED,
        * a raised `rlfabric.runtime.errors.ServiceError` becomes its status code, any other exception
          INTERNAL (logged with its traceback and counted),
        * each RPC is counted and timed in Prometheus and, when tracing is on, runs in a server span
          continuing the caller's trace.
Health and reflection RPCs bypass the interceptor: a probe must answer even when the server sheds load.

Servicer methods must be `async def` (or async generators for server streaming); a plain function would
run on the event loop and block every other RPC while it runs.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Gauge, Histogram

from rlfabric.runtime import telemetry
from rlfabric.runtime.errors import ServiceError, Unauthenticated
from rlfabric.runtime.schema import ServerConfig

log = logging.getLogger(__name__)

S = TypeVar("S")
T = TypeVar("T")

MIB = 1 << 20
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE = reflection.SERVICE_NAME
# Methods under these prefixes are never shed, counted or traced.
_EXEMPT_PREFIXES = (f"/{HEALTH_SERVICE}/", "/grpc.reflection.")

_HANDLED = Counter(
    "rlfabric_grpc_server_handled_total", "RPCs completed, by full method and status code", ["method", "code"]
)
_LATENCY = Histogram(
    "rlfabric_grpc_server_handling_seconds",
    "RPC handling time, by full method and status code",
    ["method", "code"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
_IN_FLIGHT = Gauge("rlfabric_grpc_server_in_flight", "RPCs being handled now (exempt methods excluded)")
_SHED = Counter("rlfabric_grpc_server_shed_total", "RPCs refused at the concurrency limit", ["method"])
_UNEXPECTED = Counter(
    "rlfabric_grpc_server_unexpected_errors_total",
    "Exceptions other than ServiceError raised by servicers (answered INTERNAL)",
    ["method", "exception"],
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS server. Setting `client_ca_file` turns on mTLS: every client must present a
    certificate signed by that CA, or the handshake fails."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials read from the files now (a missing file raises here, at start-up)."""
        ca = _read(self.client_ca_file) if self.client_ca_file else None
        pair = (_read(self.key_file), _read(self.cert_file))
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def _read(path: str) -> bytes:
    """The bytes of a file."""
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class GrpcServerOptions:
    """How a service's gRPC server listens and what it accepts. Services map their config onto this."""

    host: str = "127.0.0.1"
    """Interface to bind; "0.0.0.0" (or "[::]") to accept connections from other machines."""
    port: int = 0
    """TCP port; 0 binds a free ephemeral port, reported by `GrpcServer.start()`."""
    max_message_bytes: int = 64 * MIB
    """Largest message received or sent; a larger one fails that RPC with RESOURCE_EXHAUSTED."""
    max_concurrent_rpcs: int = 256
    """RPCs handled at once; beyond it, new ones are answered RESOURCE_EXHAUSTED (health exempt)."""
    keepalive_time_s: float = 30.0
    """Interval of the server's HTTP/2 keepalive pings on idle connections."""
    keepalive_timeout_s: float = 10.0
    """A connection whose keepalive ping gets no answer within this time is closed."""
    min_client_ping_interval_s: float = 10.0
    """Clients pinging more often than this are told to back off (GOAWAY too_many_pings)."""
    grace_period_s: float = 10.0
    """On stop, in-flight RPCs get this long to finish before they are cancelled."""
    tls: TlsFiles | None = None
    """TLS (mTLS when `tls.client_ca_file` is set); None serves plaintext."""
    reuse_port: bool = False
    """Bind with SO_REUSEPORT, so that several processes of one service can share the port (the kernel
    spreads connections over them). Off by default: a second server started on a taken port must fail,
    not silently share it."""

    @property
    def address(self) -> str:
        """`host:port` in the form gRPC binds (IPv6 literals bracketed)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


def options_from_config(config: ServerConfig) -> GrpcServerOptions:
    """The server options of a service's `server` config section."""
    tls = None
    if config.tls is not None:
        tls = TlsFiles(config.tls.cert_file, config.tls.key_file, config.tls.client_ca_file)
    return GrpcServerOptions(
        host=config.host,
        port=config.port,
        max_message_bytes=config.max_message_bytes,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
        keepalive_time_s=config.keepalive_time_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
        grace_period_s=config.grace_period_s,
        tls=tls,
    )


def server_channel_options(options: GrpcServerOptions) -> list[tuple[str, int]]:
    """The core channel arguments for `options`: size limits, keepalive, port sharing only when asked."""
    return [
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.keepalive_time_ms", int(options.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(options.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(options.min_client_ping_interval_s * 1000)),
        ("grpc.so_reuseport", int(options.reuse_port)),
    ]


def full_service_name(pb2_module: ModuleType, service: str) -> str:
    """The fully qualified name of `service` declared in a generated `*_pb2` module.

    >>> full_service_name(reward_pb2, "RewardService")
    'rlfabric.v1.RewardService'
    """
    return str(pb2_module.DESCRIPTOR.services_by_name[service].full_name)


def check_bearer(context: grpc.aio.ServicerContext[Any, Any], expected_token: str | None) -> None:
    """Raises `Unauthenticated` unless the call carries `authorization: Bearer <expected_token>`.

    `expected_token=None` means authentication is off and every call passes; an empty token is a
    configuration error. The comparison takes constant time.
    """
    if expected_token is None:
        return
    if not expected_token:
        raise ValueError("expected_token is empty: pass None to turn authentication off")
    presented = _bearer_token(context.invocation_metadata() or ())
    if presented is None or not hmac.compare_digest(presented.encode(), expected_token.encode()):
        raise Unauthenticated("missing or invalid bearer token")


def _bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of the first `authorization: Bearer ...` entry, or None."""
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None


def _code_of_failure(exc: BaseException, context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    """The status code an RPC ends with when its handler raised `exc`."""
    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.UNKNOWN
    if isinstance(exc, asyncio.CancelledError):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


async def _invoke_unary(behavior: Callable[..., Any], request: Any, context: Any) -> Any:
    """Calls a unary-response behavior, awaiting it if it is a coroutine."""
    result = behavior(request, context)
    return await result if inspect.isawaitable(result) else result


async def _invoke_streaming(behavior: Callable[..., Any], request: Any, context: Any) -> None:
    """Runs a stream-response behavior, writing what it yields; closes an async generator on exit.

    Writing through `context.write` from one coroutine (rather than handing gRPC a generator) keeps the
    whole RPC inside this task, so cancellation always reaches the interceptor's bookkeeping.
    """
    result = behavior(request, context)
    if inspect.isawaitable(result):
        await result
    elif isinstance(result, AsyncIterable):
        try:
            async for message in result:
                await context.write(message)
        finally:
            await result.aclose()  # type: ignore[attr-defined]
    elif result is not None:
        for message in result:
            await context.write(message)


_MakeHandler = Callable[..., grpc.RpcMethodHandler]
_Invoke = Callable[[Callable[..., Any], Any, Any], Awaitable[Any]]


def _handler_parts(handler: grpc.RpcMethodHandler) -> tuple[_MakeHandler, Any, _Invoke]:
    """(constructor for a handler of this kind, its behavior, how to invoke that behavior)."""
    if handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler, handler.stream_stream, _invoke_streaming
        return grpc.unary_stream_rpc_method_handler, handler.unary_stream, _invoke_streaming
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler, handler.stream_unary, _invoke_unary
    return grpc.unary_unary_rpc_method_handler, handler.unary_unary, _invoke_unary


class RpcInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Sheds load, maps exceptions to status codes, and records metrics and spans for each RPC.

    Invariant: `in_flight` counts the admitted RPCs whose handler has not yet returned, raised or been
    cancelled; it is incremented and decremented on the event loop only, so it needs no lock.
    """

    def __init__(self, max_concurrent_rpcs: int) -> None:
        if max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {max_concurrent_rpcs}")
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.in_flight = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The handler for the call, wrapped unless the method is exempt or unknown."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_EXEMPT_PREFIXES):
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """A handler of the same kind and serializers whose behavior runs through `_run`."""
        make, behavior, invoke = _handler_parts(handler)

        async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            return await self._run(method, context, lambda: invoke(behavior, request, context))

        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _run(
        self, method: str, context: grpc.aio.ServicerContext[Any, Any], call: Callable[[], Awaitable[T]]
    ) -> T:
        """Admits the RPC, runs `call` in a server span, answers failures, and records the outcome."""
        await self._admit(method, context)
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        parent = telemetry.extract_from_metadata(context.invocation_metadata())
        try:
            name, attributes = telemetry.rpc_span(method)
            with telemetry.span(name, parent=parent, kind=SpanKind.SERVER, attributes=attributes) as span:
                try:
                    result = await call()
                    code = context.code() or grpc.StatusCode.OK
                    return result
                except BaseException as exc:
                    code = _code_of_failure(exc, context)
                    await _answer_failure(exc, method, context)
                finally:
                    span.set_attribute(telemetry.RPC_GRPC_STATUS_CODE, code.value[0])
        finally:
            self.in_flight -= 1
            _IN_FLIGHT.dec()
            _record(method, code, time.perf_counter() - start)

    async def _admit(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Counts the RPC in, or aborts it with RESOURCE_EXHAUSTED when the server is at its limit."""
        if self.in_flight >= self.max_concurrent_rpcs:
            _SHED.labels(method).inc()
            _record(method, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server is at its limit of {self.max_concurrent_rpcs} concurrent RPCs; retry with backoff",
            )
        self.in_flight += 1
        _IN_FLIGHT.inc()


async def _answer_failure(
    exc: BaseException, method: str, context: grpc.aio.ServicerContext[Any, Any]
) -> NoReturn:
    """Ends the RPC for a handler that raised: ServiceError -> its code, anything unexpected -> INTERNAL.

    Aborts already answered and cancellations (BaseExceptions) propagate untouched.
    """
    if isinstance(exc, ServiceError):
        await context.abort(exc.code, exc.message)
    if isinstance(exc, grpc.aio.AbortError) or not isinstance(exc, Exception):
        raise exc
    _UNEXPECTED.labels(method, type(exc).__name__).inc()
    log.error("unexpected error in %s", method, exc_info=exc, extra={"method": method})
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
    )
    raise AssertionError("unreachable: context.abort raises")


def _record(method: str, code: grpc.StatusCode, seconds: float) -> None:
    """Counts one finished RPC and its duration."""
    _HANDLED.labels(method, code.name).inc()
    _LATENCY.labels(method, code.name).observe(seconds)


@dataclass(frozen=True)
class _Registration:
    """A servicer to add at start: `add(servicer, server)` is a generated `add_XServicer_to_server`."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    service_name: str
    serving: bool


class GrpcServer:
    """A gRPC server with health, reflection, limits and the interceptor; one per service process.

    Lifecycle: `add_servicer(...)` any number of times, `await start()` (returns the bound port),
    `install_signal_handlers()`, `await wait_for_termination()`. Construction touches no event loop, so
    it can happen before `asyncio.run`. Health reports each added service (and "") SERVING from start
    until stop or `set_serving(name, False)`; once stopping, every status is NOT_SERVING for good.
    """

    def __init__(self, options: GrpcServerOptions | None = None) -> None:
        self.options = options or GrpcServerOptions()
        self.interceptor = RpcInterceptor(self.options.max_concurrent_rpcs)
        self.port: int | None = None
        self._registrations: list[_Registration] = []
        self._status: dict[str, bool] = {"": True}
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._stop_task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        """RPCs being handled now (health and reflection excluded)."""
        return self.interceptor.in_flight

    def add_servicer(
        self,
        add_to_server: Callable[[S, grpc.aio.Server], None],
        servicer: S,
        service_name: str,
        *,
        serving: bool = True,
    ) -> None:
        """Registers `servicer` (added at start) under its full name, e.g. "rlfabric.v1.RewardService".

        `add_to_server` is the generated `add_XServicer_to_server`; `serving=False` starts the service's
        health status at NOT_SERVING until `set_serving(service_name, True)` (e.g. after loading a model).
        """
        if self._server is not None:
            raise RuntimeError("add_servicer must be called before start()")
        self._registrations.append(_Registration(add_to_server, servicer, service_name, serving))
        self._status[service_name] = serving

    async def start(self) -> int:
        """Binds, starts serving, and returns the bound port. Raises if the address cannot be bound."""
        if self._server is not None:
            raise RuntimeError("server already started")
        server = grpc.aio.server(
            interceptors=[self.interceptor], options=server_channel_options(self.options)
        )
        self._health = HealthServicer()
        self._register_all(server, self._health)
        self.port = self._bind(server)
        for service, serving in self._status.items():
            await self._health.set(service, _serving_status(serving))
        await server.start()
        self._server = server
        log.info("gRPC server listening", extra={"address": self.options.address, "port": self.port})
        return self.port

    def _register_all(self, server: grpc.aio.Server, health: HealthServicer) -> None:
        """Adds the servicers, health and reflection to `server`."""
        for registration in self._registrations:
            registration.add(registration.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        names = [r.service_name for r in self._registrations] + [HEALTH_SERVICE, REFLECTION_SERVICE]
        reflection.enable_server_reflection(names, server)

    def _bind(self, server: grpc.aio.Server) -> int:
        """Adds the listening port (TLS when configured) and returns the port actually bound."""
        address = self.options.address
        if self.options.tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, self.options.tls.server_credentials())
        if port == 0:
            raise RuntimeError(f"could not bind gRPC server to {address}")
        return port

    async def set_serving(self, service: str, serving: bool) -> None:
        """Sets one service's health status ("" is the whole server). Ignored once stopping."""
        self._status[service] = serving
        if self._health is not None:
            await self._health.set(service, _serving_status(serving))

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: health NOT_SERVING, refuse new RPCs, give in-flight ones `grace` seconds
        (default `options.grace_period_s`) to finish, then cancel what remains. Safe to call twice."""
        if self._server is None or self._health is None:
            return
        grace = self.options.grace_period_s if grace is None else grace
        log.info("gRPC server stopping", extra={"grace_s": grace, "in_flight": self.in_flight})
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)

    def install_signal_handlers(self) -> None:
        """Makes SIGTERM and SIGINT start `stop()` on the running loop; repeated signals are ignored."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        """Starts the graceful stop once."""
        if self._stop_task is not None:
            log.info("already stopping; ignoring signal", extra={"signal": sig.name})
            return
        log.info("received signal, stopping", extra={"signal": sig.name})
        self._stop_task = asyncio.get_running_loop().create_task(self.stop())

    async def wait_for_termination(self) -> None:
        """Returns once the server has stopped (and a signal-triggered stop has completed)."""
        if self._server is None:
            raise RuntimeError("server not started")
        await self._server.wait_for_termination()
        if self._stop_task is not None:
            await self._stop_task


def _serving_status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    """The health enum for a boolean."""
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
