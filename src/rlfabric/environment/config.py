"""Configuration of the environment service process (`rlfabric serve environment`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from rlfabric.environment.spec import EnvironmentSpec, ToolEnvironmentSpec
from rlfabric.runtime.config import StrictModel
from rlfabric.runtime.schema import METRICS_OFF, METRICS_PORTS, LogConfig, SandboxConfig, ServerConfig
from rlfabric.runtime.user_code import allow_entry_kind


class EnvironmentServerConfig(ServerConfig):
    """The environment service's server: /metrics on by default, on a port of its own."""

    metrics_port: int = Field(default=METRICS_PORTS["environment"], ge=METRICS_OFF, le=65535)
    """Port of the Prometheus /metrics endpoint, bound on `host` (default 9104); 0 picks a free port
    (printed at start), -1 turns it off."""


class EnvironmentServiceConfig(StrictModel):
    """The environment service: sessions of one environment over gRPC."""

    server: EnvironmentServerConfig = Field(default_factory=lambda: EnvironmentServerConfig(port=50054))
    """gRPC server."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    environment: EnvironmentSpec = Field(default_factory=ToolEnvironmentSpec)
    """The environment each session runs: `kind = "tools"` (the built-in ToolEnvironment, a calculator
    by default) or `kind = "python"` with `ref = "module:Class"`."""
    max_sessions: int = Field(default=1024, ge=1)
    """Sessions open at once; a Reset beyond it answers RESOURCE_EXHAUSTED."""
    session_ttl_s: float = Field(default=600.0, gt=0)
    """A session without a Step for this long is closed; a Reset may ask for less, not more."""
    step_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of each reset and step of an environment; past it the answer is status TIMEOUT."""
    max_steps: int = Field(default=64, ge=1)
    """Steps per session; the step that reaches it without the episode ending is status TRUNCATED."""
    max_action_bytes: int = Field(default=1 << 20, ge=1)
    """Largest action a Step accepts; a bigger one answers INVALID_ARGUMENT."""
    token: str | None = Field(default=None, min_length=1)
    """Bearer token required on Reset, Step and Close (health checks stay open); set it from
    RLFABRIC_ENVIRONMENT__TOKEN. The process refuses to start without it unless `insecure`."""
    stall_timeout_s: float | None = Field(default=300.0, ge=10)
    """A process whose event loop does not turn for this long (a call that blocks it and never returns:
    every RPC waits behind it) writes every stack to its log and exits with code 75, so that whoever
    started it restarts it (`runtime.watchdog`). None: never."""
    insecure: bool = False
    """Serve without credentials (`--insecure`): `token` is no longer required at start (when set it is
    still enforced) and a WARNING is logged. For tests and loopback only: without a token anyone who
    reaches the port can run the tools."""
    allowed_functions: list[str] = Field(default_factory=list)
    """Where user code (an environment class, a tool function) may be loaded from; empty allows none.
    Entries as the reward service's: a module prefix "pkg.sub", one "pkg.mod:attr", or a directory."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """The code sandbox's limits, for the `python` tool."""

    @field_validator("allowed_functions")
    @classmethod
    def _known_entry_kinds(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            allow_entry_kind(entry)
        return entries
