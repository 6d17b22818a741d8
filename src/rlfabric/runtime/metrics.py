"""Prometheus exposition: a `/metrics` HTTP server for the gRPC services, and a body for FastAPI.

Metrics live in prometheus_client's default registry (each module defines its own at import). When
`PROMETHEUS_MULTIPROC_DIR` is set (several worker processes behind one port), both exposition paths
aggregate the per-process files instead of reading this process's registry alone.
"""

from __future__ import annotations

import os
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client import start_http_server as _start_http_server

_servers: dict[int, tuple[WSGIServer, threading.Thread]] = {}


def _registry() -> CollectorRegistry:
    """The registry to expose: the multiprocess aggregate when configured, else the default one."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def start_metrics_server(host: str = "127.0.0.1", port: int = 0) -> int:
    """Serves `/metrics` from a daemon thread and returns the bound port (port 0 picks a free one)."""
    server, thread = _start_http_server(port, addr=host, registry=_registry())
    bound = int(server.server_port)
    _servers[bound] = (server, thread)
    return bound


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
