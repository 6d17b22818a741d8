"""The image's health check script (deploy/docker/healthcheck.py) against real gRPC and HTTP servers."""

from __future__ import annotations

import http.server
import importlib.util
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from types import ModuleType
from typing import Any

import grpc
import pytest
from deploy_manifests import REPO
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


@pytest.fixture(scope="module")
def healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "rlfabric_healthcheck", REPO / "deploy/docker/healthcheck.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def grpc_health() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


class Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_grpc_target(healthcheck: ModuleType, grpc_health: tuple[str, health.HealthServicer]) -> None:
    address, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("rlfabric.v1.RolloutService", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.healthy(f"grpc://{address}")
    assert not healthcheck.healthy(f"grpc://{address}/rlfabric.v1.RolloutService")
    servicer.set("rlfabric.v1.RolloutService", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.healthy(f"grpc://{address}/rlfabric.v1.RolloutService")
    assert not healthcheck.healthy(f"grpc://{address}/rlfabric.v1.Unknown")
    assert not healthcheck.healthy(f"grpc://127.0.0.1:{closed_port()}")


def test_http_target(healthcheck: ModuleType, http_server: str) -> None:
    assert healthcheck.healthy(f"http://{http_server}/healthz")
    assert not healthcheck.healthy(f"http://{http_server}/other")
    assert not healthcheck.healthy(f"http://127.0.0.1:{closed_port()}/healthz")


def test_nothing_to_check_is_healthy_and_nonsense_is_not(healthcheck: ModuleType) -> None:
    assert healthcheck.healthy(None) and healthcheck.healthy("none")
    assert not healthcheck.healthy("tcp://127.0.0.1:1")
