"""Container health check of the rlfabric image (Docker HEALTHCHECK; Kubernetes uses its own probes).

One image serves every role, so the container says what to check in RLFABRIC_HEALTHCHECK:

    grpc://HOST:PORT[/SERVICE]   grpc.health.v1 must answer SERVING for SERVICE ("" = the whole server)
    http://HOST:PORT/PATH        the URL must answer 2xx (the coordinator's /healthz)
    unset or "none"              nothing to check (one-off commands such as make-tiny-model): healthy

Exit status 0 is healthy, 1 unhealthy (what Docker expects).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from urllib.parse import urlsplit

TIMEOUT_S = 4.0


def check_grpc(netloc: str, service: str) -> bool:
    """True when the gRPC health service at `netloc` reports SERVING for `service`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(netloc) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def check_http(url: str) -> bool:
    """True when `url` answers with a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError):
        return False


def healthy(target: str | None) -> bool:
    """Checks `target` (the RLFABRIC_HEALTHCHECK syntax above)."""
    if not target or target == "none":
        return True
    parts = urlsplit(target)
    if parts.scheme == "grpc":
        return check_grpc(parts.netloc, parts.path.lstrip("/"))
    if parts.scheme in ("http", "https"):
        return check_http(target)
    print(f"rlfabric-healthcheck: unsupported RLFABRIC_HEALTHCHECK {target!r}", file=sys.stderr)
    return False


def main() -> int:
    return 0 if healthy(os.environ.get("RLFABRIC_HEALTHCHECK")) else 1


if __name__ == "__main__":
    sys.exit(main())
