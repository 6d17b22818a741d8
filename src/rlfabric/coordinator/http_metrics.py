"""Prometheus metrics of the coordinator's HTTP API, by an ASGI middleware (no dependency of its own).

    rlfabric_coordinator_http_requests_total{method,route,status}          counter
    rlfabric_coordinator_http_request_duration_seconds{method,route}       histogram

`route` is the matched route's template (`/v1/runs/{run_id}`), never the raw path, so that a run id or a
scanner's made-up URL cannot grow the series without bound; a request no route matched is `unmatched`.
The middleware sits outermost, so requests refused before routing (413, a 500) are counted too.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"

_REQUESTS = Counter(
    "rlfabric_coordinator_http_requests_total",
    "HTTP requests answered, by method, route template and status code",
    ["method", "route", "status"],
)
_DURATION = Histogram(
    "rlfabric_coordinator_http_request_duration_seconds",
    "Time from a request's arrival to the end of its response, by method and route template",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def route_of(scope: Scope) -> str:
    """The template of the route the router matched into `scope`, or UNMATCHED."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


class StatusRecorder:
    """Wraps an ASGI `send` to remember the response's status code: 500 until a response starts (what
    the server answers when the app raises before one)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.code = 500

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.code = int(message["status"])
        await self._send(message)


class RequestMetrics:
    """ASGI middleware counting and timing each HTTP request by method, route template and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = StatusRecorder(send)
        try:
            await self.app(scope, receive, status.send)
        finally:
            method, route = scope["method"], route_of(scope)
            _REQUESTS.labels(method, route, str(status.code)).inc()
            _DURATION.labels(method, route).observe(time.perf_counter() - start)
