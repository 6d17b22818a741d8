"""Configuration sections that every service shares: its server, TLS, logging and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from rlfabric.runtime.config import StrictModel

if TYPE_CHECKING:
    from rlfabric.runtime.sandbox import SandboxLimits


METRICS_OFF = -1
"""`server.metrics_port` value that turns a service's /metrics endpoint off."""

METRICS_PORTS = {"rollout": 9101, "reward": 9102, "learner": 9103, "environment": 9104}
"""Default /metrics port of each gRPC service (the coordinator serves /metrics on its API port). Distinct,
so that one of each can run on a host with its defaults; several of one kind on a host need their own
ports (0 picks a free one, as `rlfabric up` and the tests do)."""


class TlsConfig(StrictModel):
    """TLS for a gRPC server. Setting `client_ca_file` turns on mutual TLS (clients must present a
    certificate signed by that CA)."""

    cert_file: str
    """PEM certificate chain of the server."""
    key_file: str
    """PEM private key of the server."""
    client_ca_file: str | None = None
    """PEM CA bundle used to verify client certificates; set it to require mTLS."""


class ServerConfig(StrictModel):
    """The gRPC server of a service."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; use 0.0.0.0 in containers."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port to bind; 0 picks a free port (printed at start)."""
    max_message_bytes: int = Field(default=64 << 20, ge=1024)
    """Largest message accepted or sent, in bytes; bigger ones are refused with RESOURCE_EXHAUSTED."""
    max_concurrent_rpcs: int = Field(default=256, ge=1)
    """RPCs in flight beyond this are shed with RESOURCE_EXHAUSTED (health checks are exempt)."""
    grace_period_s: float = Field(default=10.0, ge=0)
    """On SIGTERM: stop accepting, then give in-flight RPCs this long to finish."""
    keepalive_time_s: float = Field(default=30.0, gt=0)
    """Interval of HTTP/2 keepalive pings on idle connections."""
    keepalive_timeout_s: float = Field(default=10.0, gt=0)
    """A connection whose ping is not answered within this is closed."""
    tls: TlsConfig | None = None
    """TLS material; plaintext when unset (fine on loopback, not across machines)."""
    metrics_port: int = Field(default=METRICS_OFF, ge=METRICS_OFF, le=65535)
    """Port of the Prometheus /metrics endpoint, bound on `host`; 0 picks a free port (printed at start),
    -1 (`METRICS_OFF`) turns it off. Each service's server section sets its own default (METRICS_PORTS)."""


class SandboxConfig(StrictModel):
    """A server's limits for the code sandbox (`runtime.sandbox`: the reward's `code_exec`, the environment's
    `python` tool). A request may only tighten them: a larger value, or `allow_unisolated` where the server
    disallows it, is INVALID_ARGUMENT."""

    cpu_s: int = Field(default=5, gt=0)
    """CPU-time limit per test process (RLIMIT_CPU), seconds."""
    wall_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit per test process, seconds; the process group is killed past it."""
    total_wall_s: float = Field(default=60.0, gt=0)
    """Wall-clock budget for all of one item's tests, seconds."""
    memory_mb: int = Field(default=512, gt=0)
    """Address-space limit per test process (RLIMIT_AS), MiB."""
    max_processes: int = Field(default=32, gt=0)
    """Process/thread limit (RLIMIT_NPROC) for the sandbox uid."""
    file_size_mb: int = Field(default=8, gt=0)
    """Largest file a program may write, stdout included (RLIMIT_FSIZE), MiB."""
    max_open_files: int = Field(default=64, gt=0)
    """Open file descriptor limit (RLIMIT_NOFILE)."""
    tmpfs_mb: int = Field(default=64, gt=0)
    """Size of a program's private /tmp (its working directory lives there), MiB."""
    allow_unisolated: bool = False
    """Whether a request may run code where network/pid/mount namespaces are unavailable (rlimits
    only): unsafe for untrusted code."""

    def to_limits(self, wall_s: float | None = None) -> SandboxLimits:
        """These limits as one program run's `SandboxLimits`, with `wall_s` in place of the configured one."""
        from rlfabric.runtime.sandbox import SandboxLimits

        return SandboxLimits(
            cpu_s=self.cpu_s,
            wall_s=self.wall_s if wall_s is None else wall_s,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
            file_size_mb=self.file_size_mb,
            max_open_files=self.max_open_files,
            tmpfs_mb=self.tmpfs_mb,
        )


class LogConfig(StrictModel):
    """Logging of a service process."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Minimum level written."""
    format: Literal["json", "text"] = "json"
    """json: one object per line (for log shippers); text: for people at a terminal."""


class RedisConfig(StrictModel):
    """Where run state and the scored-group streams live."""

    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL. The server must run with appendonly yes and maxmemory-policy noeviction."""
    socket_timeout_s: float = Field(default=10.0, gt=0)
    """Timeout of a single Redis command."""

    def connect(self) -> Any:
        """A `redis.asyncio.Redis` (bytes replies) that rides out a Redis restart: a command whose
        connection fails is retried with exponential backoff for about 30 s, then fails loudly."""
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError, TimeoutError

        return Redis.from_url(
            self.url,
            socket_timeout=self.socket_timeout_s,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=20),
            retry_on_error=[ConnectionError, TimeoutError],
        )


class ClientTlsConfig(StrictModel):
    """TLS for a gRPC client."""

    ca_file: str
    """PEM CA bundle that signed the server's certificate."""
    cert_file: str | None = None
    """Client certificate, for servers that require mTLS."""
    key_file: str | None = None
    """Private key of `cert_file`."""

    @model_validator(mode="after")
    def _pair(self) -> ClientTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be set together")
        return self
