"""Prometheus exposition: a `/metrics` HTTP server for the gRPC services, and a body for FastAPI.

Metrics live in prometheus_client's default registry (each module defines its own at import). When
`PROMETHEUS_MULTIPROC_DIR` is set (several worker processes behind one port), both exposition paths
aggregate the per-process files instead of reading this process's registry alone. A family without
samples (a labelled metric no code path has touched in this process, e.g. one registered by a module the
process imports but never runs) is left out, as the Go client does: a scrape shows what the process
measures.

Names follow the Prometheus conventions: base units in the name (`_seconds`, `_bytes`), `_total` on
counters, `_ratio` for a 0-1 share; tests/integration/test_metrics_lint.py checks every service's scrape.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from rlfabric.runtime.schema import METRICS_OFF, ServerConfig

_servers: dict[int, tuple[WSGIServer, threading.Thread]] = {}


class _NonEmpty(Collector):
    """The families of `source` that have samples."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        return (family for family in self.source.collect() if family.samples)


def _registry() -> CollectorRegistry:
    """The registry to expose: the multiprocess aggregate when configured, else the default one; either
    without its empty families."""
    source = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        source = CollectorRegistry()
        multiprocess.MultiProcessCollector(source)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_NonEmpty(source))
    return registry


def start_metrics_server(host: str = "127.0.0.1", port: int = 0) -> int:
    """Serves `/metrics` from a daemon thread and returns the bound port (port 0 picks a free one)."""
    server, thread = _start_http_server(port, addr=host, registry=_registry())
    bound = int(server.server_port)
    _servers[bound] = (server, thread)
    return bound


def serve_metrics(service: str, server: ServerConfig) -> int | None:
    """Starts the service's /metrics server as `server.metrics_port` says (METRICS_OFF: none) and prints
    where it listens; returns the bound port."""
    if server.metrics_port == METRICS_OFF:
        return None
    port = start_metrics_server(server.host, server.metrics_port)
    print(f"rlfabric {service} metrics on http://{server.host}:{port}/metrics", flush=True)
    return port


def stop_metrics_server(port: int) -> None:
    """Stops the server `start_metrics_server` returned `port` for; unknown ports are ignored."""
    entry = _servers.pop(port, None)
    if entry is None:
        return
    server, thread = entry
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def metrics_response() -> tuple[bytes, str]:
    """(body, content type) of a Prometheus scrape, e.g. for a FastAPI `Response(content, media_type=)`."""
    return generate_latest(_registry()), CONTENT_TYPE_LATEST
