"""Trace-context propagation (on and off) and the JSON log format."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN

from rlfabric.contracts import wire
from rlfabric.runtime import telemetry
from rlfabric.runtime.logs import setup_logging
from rlfabric.v1 import common_pb2


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert telemetry.setup_tracing("unit-test", exporter=exporter)
    yield exporter
    telemetry.shutdown_tracing()


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)


def stored_context() -> common_pb2.TraceContext:
    """The current context as a payload stores it (the coordinator's side)."""
    return wire.trace_to_proto(telemetry.trace_carrier())


def read_context(message: common_pb2.TraceContext) -> otel_context.Context | None:
    """A stored context as a parent (the learner's side)."""
    return telemetry.context_from_carrier(wire.trace_from_proto(message))


def test_context_round_trips_through_grpc_metadata(exporter: InMemorySpanExporter) -> None:
    with telemetry.span("client") as client:
        metadata = telemetry.inject_metadata([("x-request-id", "7")])
    assert metadata[0] == ("x-request-id", "7")
    assert dict(metadata)["traceparent"].startswith("00-")

    parent = telemetry.extract_from_metadata([*metadata, ("payload-bin", b"\x00")])
    with telemetry.span("server", parent=parent) as server:
        pass
    assert server.get_span_context().trace_id == client.get_span_context().trace_id
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert finished["server"].parent is not None
    assert finished["server"].parent.span_id == client.get_span_context().span_id


def test_context_round_trips_through_the_trace_context_proto(exporter: InMemorySpanExporter) -> None:
    with telemetry.span("produce") as producer:
        stored = common_pb2.TraceContext.FromString(stored_context().SerializeToString())
    trace_id = format(producer.get_span_context().trace_id, "032x")
    assert stored.traceparent.split("-")[1] == trace_id

    with telemetry.span("consume", parent=read_context(stored)) as consumer:
        pass
    assert consumer.get_span_context().trace_id == producer.get_span_context().trace_id


def test_context_round_trips_through_http_headers(exporter: InMemorySpanExporter) -> None:
    with telemetry.span("call") as caller:
        headers = telemetry.inject_headers({"Accept": "application/json"})
    parent = telemetry.extract_from_headers({k.title(): v for k, v in headers.items()})
    with telemetry.span("handle", parent=parent) as handler:
        pass
    assert handler.get_span_context().trace_id == caller.get_span_context().trace_id


def test_everything_is_a_no_op_when_tracing_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in (None, "none"):
        if value is None:
            monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        else:
            monkeypatch.setenv("OTEL_TRACES_EXPORTER", value)
        assert not telemetry.setup_tracing("unit-test")
        assert not telemetry.tracing_enabled()
    with telemetry.span("ignored") as span:
        assert span is INVALID_SPAN
        assert telemetry.inject_metadata([("k", "v")]) == [("k", "v")]
        assert telemetry.inject_headers({}) == {}
        assert stored_context() == common_pb2.TraceContext()
    assert (
        telemetry.extract_from_metadata([("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")]) is None
    )
    assert read_context(common_pb2.TraceContext(traceparent="00-x")) is None


def test_exporter_and_service_name_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        telemetry.setup_tracing("unit-test")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none,console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    try:
        assert telemetry.setup_tracing("unit-test")
        assert telemetry.setup_tracing("unit-test")  # idempotent
        provider = telemetry._state.provider
        assert provider is not None
        assert provider.resource.attributes["service.name"] == "from-env"
    finally:
        telemetry.shutdown_tracing()
    assert not telemetry.tracing_enabled()


def test_json_logs_carry_fields_extras_and_the_active_trace(
    exporter: InMemorySpanExporter, log_stream: io.StringIO
) -> None:
    setup_logging("reward", level="DEBUG", stream=log_stream)
    setup_logging("reward", level="DEBUG", stream=log_stream)  # idempotent: still one handler
    log = logging.getLogger("rlfabric.test")
    log.info("plain %s", "message", extra={"batch": 8, "where": object()})
    with telemetry.span("work") as span:
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")

    first, second = (json.loads(line) for line in log_stream.getvalue().splitlines())
    assert first["msg"] == "plain message"
    assert (first["level"], first["logger"], first["service"], first["batch"]) == (
        "INFO",
        "rlfabric.test",
        "reward",
        8,
    )
    assert first["ts"].endswith("+00:00")
    assert "trace_id" not in first
    assert second["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert second["span_id"] == format(span.get_span_context().span_id, "016x")
    assert "ValueError: boom" in second["exc"]


def test_text_logs_and_unknown_formats(log_stream: io.StringIO) -> None:
    setup_logging("coordinator", fmt="text", stream=log_stream)
    logging.getLogger("rlfabric.test").warning("careful")
    assert "WARNING coordinator rlfabric.test: careful" in log_stream.getvalue()
    with pytest.raises(ValueError, match="log format"):
        setup_logging("coordinator", fmt="xml", stream=log_stream)  # type: ignore[arg-type]


def test_shared_modules_import_neither_torch_nor_the_tracing_sdk() -> None:
    code = (
        "import sys\n"
        "import rlfabric.runtime.grpc_server, rlfabric.runtime.grpc_client, rlfabric.runtime.logs\n"
        "import rlfabric.runtime.metrics, rlfabric.runtime.telemetry, rlfabric.runtime.errors\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('opentelemetry.sdk')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_step_span_links_the_groups_it_consumed(exporter: InMemorySpanExporter) -> None:
    """The learner's shape: each group's stored context becomes a link of the step's span and the parent
    of the group's own closing span."""
    stored = []
    for name in ("group-a", "group-b"):
        with telemetry.span(name):
            stored.append(common_pb2.TraceContext.FromString(stored_context().SerializeToString()))
    contexts = [read_context(t) for t in stored]
    with telemetry.span("learner.step", links=[c for c in contexts if c is not None]):
        pass
    finished = {s.name: s for s in exporter.get_finished_spans()}
    linked = {link.context.span_id for link in finished["learner.step"].links}
    assert linked == {finished["group-a"].context.span_id, finished["group-b"].context.span_id}


@pytest.mark.parametrize(
    ("traces", "general", "expected"),
    [
        (None, None, "OTLPSpanExporter@grpc"),
        (None, "grpc", "OTLPSpanExporter@grpc"),
        (None, "http/protobuf", "OTLPSpanExporter@http"),
        ("http/protobuf", "grpc", "OTLPSpanExporter@http"),  # the signal's own variable wins
        ("GRPC", "http/protobuf", "OTLPSpanExporter@grpc"),
    ],
)
def test_the_otlp_protocol_picks_the_exporter(
    monkeypatch: pytest.MonkeyPatch, traces: str | None, general: str | None, expected: str
) -> None:
    for variable, value in zip(telemetry.PROTOCOL_ENVS, (traces, general), strict=True):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    exporter = telemetry._exporter_named("otlp")
    try:
        transport = "http" if ".proto.http." in type(exporter).__module__ else "grpc"
        assert f"{type(exporter).__name__}@{transport}" == expected
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("variable", telemetry.PROTOCOL_ENVS)
def test_an_unknown_otlp_protocol_is_a_config_error_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    for other in telemetry.PROTOCOL_ENVS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(variable, "http/json")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    with pytest.raises(ValueError, match=f"{variable}='http/json'"):
        telemetry.setup_tracing("unit-test")
    assert not telemetry.tracing_enabled()


def test_semantic_convention_names_and_attributes() -> None:
    assert telemetry.rpc_span("/rlfabric.v1.RolloutService/Generate") == (
        "rlfabric.v1.RolloutService/Generate",
        {"rpc.system": "grpc", "rpc.service": "rlfabric.v1.RolloutService", "rpc.method": "Generate"},
    )
    assert telemetry.server_attributes("10.0.0.7:50051") == {
        "server.address": "10.0.0.7",
        "server.port": 50051,
    }
    assert telemetry.server_attributes("[::1]:9") == {"server.address": "::1", "server.port": 9}
    assert telemetry.server_attributes("unix:/tmp/s") == {"server.address": "unix:/tmp/s"}
    assert telemetry.db_attributes("XADD") == {"db.system": "redis", "db.operation.name": "XADD"}
    assert telemetry.http_server_attributes("GET", "/v1/runs/{run_id}", "/v1/runs/a", 200) == {
        "http.request.method": "GET",
        "http.route": "/v1/runs/{run_id}",
        "url.path": "/v1/runs/a",
        "http.response.status_code": 200,
    }


def test_a_backdated_span_starts_when_asked(exporter: InMemorySpanExporter) -> None:
    with telemetry.span("read", start_time_ns=1_000):
        pass
    (finished,) = exporter.get_finished_spans()
    assert finished.start_time == 1_000


def test_new_trace_starts_a_root_span_under_a_current_one(exporter: InMemorySpanExporter) -> None:
    with telemetry.span("request") as request, telemetry.span("group", parent=telemetry.NEW_TRACE) as group:
        pass
    assert group.get_span_context().trace_id != request.get_span_context().trace_id
    assert {s.name: s.parent for s in exporter.get_finished_spans()}["group"] is None
