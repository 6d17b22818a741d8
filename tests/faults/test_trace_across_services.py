"""One trace across the four services, exported over real OTLP: a receiver on loopback takes gRPC (from the
reward service and the rollout replica) and HTTP/protobuf (from the learner and the coordinator), the stack
runs a short run, and one scored group's spans are followed from the coordinator's dispatch through
Generate, Score and the Redis enqueue to the learner's step that trained it."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from fault_stack import Stack, run_spec
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

ROLLOUT = "rlfabric.v1.RolloutService"
REWARD = "rlfabric.v1.RewardService"
CLIENT, SERVER = Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_SERVER


@dataclass(frozen=True)
class Received:
    """One exported span, with the service that sent it and the protocol it came by."""

    service: str
    protocol: str
    span: Span

    @property
    def attributes(self) -> dict[str, Any]:
        return {a.key: _value(a.value) for a in self.span.attributes}


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value") or "string_value")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: gRPC (`TraceService/Export`) and HTTP (`POST /v1/traces`) on loopback."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.lock = threading.Lock()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest, protocol: str) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(Received(resource["service.name"], protocol, span))

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        self.take(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()

    def http_handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/traces", self.path
                receiver.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body), "http/protobuf")
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def named(self, name: str, **where: Any) -> list[Received]:
        with self.lock:
            spans = list(self.spans)
        return [r for r in spans if r.span.name == name and all(_matches(r, k, v) for k, v in where.items())]


def _matches(received: Received, key: str, value: Any) -> bool:
    return (
        getattr(received, key) == value
        if key in ("service", "protocol")
        else getattr(received.span, key) == value
    )


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int, int]]:
    """The receiver, its gRPC port and its HTTP port; both stopped after the test."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), receiver.http_handler())
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield receiver, grpc_port, http.server_address[1]
    http.shutdown()
    thread.join(10)
    server.stop(0)


class TracedStack(Stack):
    """A Stack whose services each get their role's extra environment (here: where to export spans)."""

    role_env: dict[str, dict[str, str]]

    def _proc(
        self, name: str, role: str, argv: list[str], ready: str, timeout_s: float = 180, **kw: Any
    ) -> str:
        if kw.get("env") is not None:
            kw["env"] = {**kw["env"], **self.role_env.get(role, {})}
        return super()._proc(name, role, argv, ready, timeout_s, **kw)


def export_env(protocol: str, port: int) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def wait_for(found: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := found():
            return result
        time.sleep(0.2)
    raise AssertionError(f"not received in {timeout_s} s: {what}")


def test_one_scored_groups_trace_crosses_all_four_services(
    tmp_path: Path, tiny_model_dir: Path, receiver: tuple[Receiver, int, int]
) -> None:
    spans, grpc_port, http_port = receiver
    spec = run_spec(tmp_path, tiny_model_dir, train={"steps": 2, "checkpoint_every": 2})
    stack = TracedStack(tmp_path, spec)
    by_grpc, by_http = export_env("grpc", grpc_port), export_env("http/protobuf", http_port)
    stack.role_env = {"reward": by_grpc, "rollout": by_grpc, "learner": by_http, "coordinator": by_http}
    try:
        stack.start()
        stack.finish(timeout_s=60)
        trained = wait_for(lambda: spans.named("learner.trained"), 15, "a learner.trained span")[0]
        trace_id = trained.span.trace_id
        wait_for(lambda: spans.named(f"{REWARD}/Score", trace_id=trace_id, kind=SERVER), 15, "Score spans")
        assert_one_trace(spans, trained)
        assert_the_step_links_the_group(spans, trained)
        assert_the_submission_is_an_http_span(spans)
    finally:
        stack.stop()


def one(spans: list[Received], what: str) -> Received:
    assert len(spans) == 1, (what, spans)
    return spans[0]


def assert_one_trace(spans: Receiver, trained: Received) -> None:
    """group (coordinator) -> Generate CLIENT -> Generate SERVER (rollout), -> Score CLIENT -> Score
    SERVER (reward), -> XADD; the group's stored context -> learner.trained (learner)."""
    trace_id = trained.span.trace_id
    group_id = trained.attributes["group_id"]
    group = one(spans.named("group", trace_id=trace_id, service="rlfabric-coordinator"), "group")
    assert group.attributes["group_id"] == group_id and group.protocol == "http/protobuf"
    assert trained.span.parent_span_id == group.span.span_id and trained.service == "rlfabric-learner"
    for service, method, server_service in ((ROLLOUT, "Generate", "rlfabric-rollout"),
                                            (REWARD, "Score", "rlfabric-reward")):  # fmt: skip
        name = f"{service}/{method}"
        clients = spans.named(name, trace_id=trace_id, kind=CLIENT, service="rlfabric-coordinator")
        servers = spans.named(name, trace_id=trace_id, kind=SERVER, service=server_service)
        assert clients and servers, name
        rpc = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "rpc.grpc.status_code": 0}
        for client in clients:
            assert client.span.parent_span_id == group.span.span_id
            assert client.attributes.items() >= rpc.items()
            assert client.attributes["server.address"] == "127.0.0.1"
            assert isinstance(client.attributes["server.port"], int)
        client_ids = {c.span.span_id for c in clients}
        for server in servers:
            assert server.span.parent_span_id in client_ids and server.protocol == "grpc"
            assert server.attributes == rpc
    xadd = one(spans.named("XADD", trace_id=trace_id), "XADD")
    assert (xadd.span.kind, xadd.span.parent_span_id) == (CLIENT, group.span.span_id)
    assert xadd.attributes == {"db.system": "redis", "db.operation.name": "XADD"}


def assert_the_step_links_the_group(spans: Receiver, trained: Received) -> None:
    """The step batches groups: its span and the read that fetched them link to each group's trace."""
    group_link = (trained.span.trace_id, trained.span.parent_span_id)
    for name in ("learner.step", "XREADGROUP"):
        linked = [
            r
            for r in spans.named(name, service="rlfabric-learner")
            if group_link in {(link.trace_id, link.span_id) for link in r.span.links}
        ]
        assert len(linked) == 1, name
    read = spans.named("XREADGROUP", service="rlfabric-learner")[0]
    assert read.attributes["db.system"] == "redis" and read.attributes["db.operation.name"] == "XREADGROUP"
    step = [s for s in spans.named("learner.step") if s.attributes["step"] == trained.attributes["step"]]
    assert group_link in {(link.trace_id, link.span_id) for link in one(step, "step").span.links}


def assert_the_submission_is_an_http_span(spans: Receiver) -> None:
    submit = one(spans.named("POST /v1/runs", service="rlfabric-coordinator"), "POST /v1/runs")
    assert submit.span.kind == SERVER
    assert submit.attributes == {
        "http.request.method": "POST",
        "http.route": "/v1/runs",
        "url.path": "/v1/runs",
        "http.response.status_code": 201,
    }
