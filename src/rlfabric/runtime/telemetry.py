"""OpenTelemetry tracing set up from the standard OTEL_* environment variables, and context propagation.

Tracing is off unless `OTEL_TRACES_EXPORTER` names an exporter ("console", "otlp", or a comma-separated
list of them); when off, the SDK is not even imported and every helper here returns at once without
touching OpenTelemetry, so instrumented code costs a flag check. The OTLP exporter speaks the protocol
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`, else "grpc") names: "grpc" or
"http/protobuf"; it reads its own variables (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`,
...); the sampler honours `OTEL_TRACES_SAMPLER`; `OTEL_SERVICE_NAME` overrides the name a service passes in.

Spans follow OpenTelemetry's semantic conventions; the helpers below build their names and attributes:
    gRPC calls       `rpc_span`: "{rpc.service}/{rpc.method}", CLIENT or SERVER, rpc.* attributes
    HTTP requests    `http_server_attributes`: "{method} {route}", SERVER, http.* and url.path
    Redis commands   `db_attributes`: "{db.operation.name}", CLIENT, db.system = "redis"

A trace crosses three kinds of boundary, each with its pair of helpers:
    gRPC calls       inject_metadata / extract_from_metadata   (W3C `traceparent` / `tracestate` keys)
    HTTP requests    inject_headers / extract_from_headers
    stored payloads  trace_carrier / context_from_carrier      (as `rlfabric.v1.TraceContext` through
                                                                 `contracts.wire`, e.g. in a ScoredGroup)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
"""Where the OTLP protocol is read, the signal-specific variable first."""
PROTOCOLS = ("grpc", "http/protobuf")

# Attribute names of the semantic conventions used here (RPC, HTTP, database, server).
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
URL_PATH = "url.path"
DB_SYSTEM = "db.system"
DB_OPERATION_NAME = "db.operation.name"
_TRACE_CONTEXT = TraceContextTextMapPropagator()
NEW_TRACE = otel_context.Context()
"""`parent=NEW_TRACE` starts a trace of its own whatever span is current: the run's tasks inherit the
context of the HTTP request that submitted the run, and a group is its own trace, not part of that one."""


@dataclass
class _TracingState:
    """The process's tracing setup; `provider is None` means tracing is off."""

    provider: TracerProvider | None = None
    tracer: trace.Tracer | None = None
    global_provider_set: bool = False


_state = _TracingState()


def tracing_enabled() -> bool:
    """True once `setup_tracing` has installed an exporter (and until `shutdown_tracing`)."""
    return _state.provider is not None


def setup_tracing(service_name: str, *, exporter: SpanExporter | None = None) -> bool:
    """Turns tracing on as the OTEL_* variables say; returns whether it is on.

    `exporter`, when given, is used instead of the environment (tests pass an in-memory one) and spans
    are exported synchronously. Idempotent: a second call while tracing is on changes nothing. The first
    provider created also becomes OpenTelemetry's global one, so libraries' own spans join the trace.
    """
    if _state.provider is not None:
        return True
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    processors = [SimpleSpanProcessor(exporter)] if exporter is not None else _processors_from_env()
    if not processors:
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    for processor in processors:
        provider.add_span_processor(processor)
    if not _state.global_provider_set:
        trace.set_tracer_provider(provider)
        _state.global_provider_set = True
    _state.provider = provider
    _state.tracer = provider.get_tracer("rlfabric")
    return True


def shutdown_tracing() -> None:
    """Flushes pending spans and turns tracing off (for process exit and for tests)."""
    provider, _state.provider, _state.tracer = _state.provider, None, None
    if provider is not None:
        provider.shutdown()


def _processors_from_env() -> list[SpanProcessor]:
    """Span processors for the exporters named in OTEL_TRACES_EXPORTER; empty when unset or "none"."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    names = [n.strip().lower() for n in os.environ.get(EXPORTER_ENV, "").split(",") if n.strip()]
    return [BatchSpanProcessor(_exporter_named(n)) for n in names if n != "none"]


def _exporter_named(name: str) -> SpanExporter:
    """The exporter for one OTEL_TRACES_EXPORTER entry; an unknown name is a configuration error."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name == "otlp":
        return _otlp_exporter(otlp_protocol())
    raise ValueError(f"{EXPORTER_ENV}={name!r} is not supported (use 'otlp', 'console' or 'none')")


def otlp_protocol() -> str:
    """The OTLP protocol the environment asks for ("grpc" when unset); another value is a config error."""
    for variable in PROTOCOL_ENVS:
        value = os.environ.get(variable, "").strip().lower()
        if value:
            if value not in PROTOCOLS:
                raise ValueError(f"{variable}={value!r} is not supported (use 'grpc' or 'http/protobuf')")
            return value
    return "grpc"


def _otlp_exporter(protocol: str) -> SpanExporter:
    """The OTLP span exporter speaking `protocol` (one of PROTOCOLS)."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


@contextlib.contextmanager
def span(
    name: str,
    *,
    parent: otel_context.Context | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    links: Iterable[otel_context.Context] = (),
    start_time_ns: int | None = None,
) -> Iterator[trace.Span]:
    """Runs the block in a new current span (a child of `parent`, else of the current span), linked to
    the spans current in `links` (e.g. the groups one learner step consumed: a step has many causes).
    `start_time_ns` (`time.time_ns()`) backdates the start, to record work that is known only once done.

    When tracing is off it yields `trace.INVALID_SPAN` and does nothing else. Exceptions escaping the
    block are recorded on the span and re-raised.
    """
    if _state.tracer is None:
        yield trace.INVALID_SPAN
        return
    span_links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in links]
    with _state.tracer.start_as_current_span(
        name, context=parent, kind=kind, attributes=attributes, links=span_links, start_time=start_time_ns
    ) as s:
        yield s


def start_span(name: str, *, kind: trace.SpanKind, attributes: Mapping[str, str | int]) -> trace.Span:
    """A started span, child of the current one and not made current, for work that ends in a callback
    (the caller calls `end()`); `trace.INVALID_SPAN` when tracing is off."""
    if _state.tracer is None:
        return trace.INVALID_SPAN
    return _state.tracer.start_span(name, kind=kind, attributes=attributes)


def rpc_span(full_method: str) -> tuple[str, dict[str, str | int]]:
    """The span name and attributes of a gRPC call to `full_method` ("/pkg.Service/Method"), both sides:
    ("pkg.Service/Method", {rpc.system: "grpc", rpc.service: "pkg.Service", rpc.method: "Method"})."""
    service, _, method = full_method.lstrip("/").partition("/")
    return f"{service}/{method}", {RPC_SYSTEM: "grpc", RPC_SERVICE: service, RPC_METHOD: method}


def server_attributes(target: str) -> dict[str, str | int]:
    """`server.address` and `server.port` of a "host:port" gRPC target ("[v6]:port" included); only the
    address when the target names no port (a "unix:" path, a name resolved elsewhere)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return {SERVER_ADDRESS: target}
    return {SERVER_ADDRESS: host.removeprefix("[").removesuffix("]"), SERVER_PORT: int(port)}


def http_server_attributes(method: str, route: str, path: str, status: int) -> dict[str, str | int]:
    """The attributes of an HTTP server span; its name is f"{method} {route}"."""
    return {
        HTTP_REQUEST_METHOD: method,
        HTTP_ROUTE: route,
        URL_PATH: path,
        HTTP_RESPONSE_STATUS_CODE: status,
    }


def db_attributes(operation: str) -> dict[str, str | int]:
    """The attributes of a Redis command's span (named after `operation`, e.g. "XADD")."""
    return {DB_SYSTEM: "redis", DB_OPERATION_NAME: operation}


def inject_metadata(metadata: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Appends the current trace context to gRPC call metadata (in place) and returns the list."""
    if _state.provider is None:
        return metadata
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    metadata.extend(carrier.items())
    return metadata


def extract_from_metadata(invocation_metadata: Iterable[Any] | None) -> otel_context.Context | None:
    """The trace context carried by incoming gRPC metadata, or None when tracing is off or none came.

    `invocation_metadata` is what `context.invocation_metadata()` returns: (key, value) pairs, a
    `grpc.aio.Metadata` included. Binary (`-bin`) entries are ignored: trace context headers are text.
    """
    if _state.provider is None or not invocation_metadata:
        return None
    carrier = {key: value for key, value in invocation_metadata if isinstance(value, str)}
    return propagate.extract(carrier)


def inject_headers(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Adds the current trace context to outgoing HTTP headers (in place) and returns them."""
    if _state.provider is not None:
        propagate.inject(headers)
    return headers


def extract_from_headers(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The trace context of an incoming HTTP request, or None when tracing is off."""
    if _state.provider is None:
        return None
    return propagate.extract({key.lower(): value for key, value in headers.items()})


def trace_carrier() -> dict[str, str]:
    """The current span's context as W3C fields (`traceparent`, and `tracestate` when set), to store with
    a payload (`rlfabric.contracts.wire.trace_to_proto`); {} when tracing is off."""
    if _state.provider is None:
        return {}
    carrier: dict[str, str] = {}
    _TRACE_CONTEXT.inject(carrier)
    return {key: value for key, value in carrier.items() if key in ("traceparent", "tracestate")}


def context_from_carrier(carrier: Mapping[str, str]) -> otel_context.Context | None:
    """The context stored by `trace_carrier`, to pass as `parent=`; None when off or without a
    `traceparent`."""
    if _state.provider is None or not carrier.get("traceparent"):
        return None
    return _TRACE_CONTEXT.extract(dict(carrier))


def current_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span as lowercase hex, or None when there is no valid span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
