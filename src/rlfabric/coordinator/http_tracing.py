"""Trace spans of the coordinator's HTTP API, by an ASGI middleware, per OpenTelemetry's HTTP conventions.

Each request is a SERVER span named "{method} {route}" (just "{method}" when no route matched), a child of
the caller's trace context when the request carries one (`traceparent`), with `http.request.method`,
`http.route` (the template, as in the metrics: `/v1/runs/{run_id}`), `url.path` and
`http.response.status_code`. A no-op while tracing is off.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Receive, Scope, Send

from rlfabric.coordinator.http_metrics import UNMATCHED, StatusRecorder, route_of
from rlfabric.runtime import telemetry


class RequestSpans:
    """ASGI middleware running each HTTP request in a SERVER span."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not telemetry.tracing_enabled():
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = telemetry.extract_from_headers(headers)
        status = StatusRecorder(send)
        with telemetry.span(method, parent=parent, kind=SpanKind.SERVER) as span:
            try:
                await self.app(scope, receive, status.send)
            finally:
                route = route_of(scope)
                span.update_name(method if route == UNMATCHED else f"{method} {route}")
                attributes = telemetry.http_server_attributes(method, route, scope["path"], status.code)
                if route == UNMATCHED:
                    del attributes[telemetry.HTTP_ROUTE]
                span.set_attributes(attributes)
                if status.code >= 500:
                    span.set_status(trace.StatusCode.ERROR)
