"""Configuration of the reward service process (`rlfabric serve reward`).

`SandboxConfig` and `allow_entry_kind` live in `rlfabric.runtime` (the environment service shares them)
and are imported here under their old names."""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from rlfabric.runtime.config import StrictModel
from rlfabric.runtime.schema import METRICS_OFF, METRICS_PORTS, LogConfig, SandboxConfig, ServerConfig
from rlfabric.runtime.user_code import allow_entry_kind


class RewardServerConfig(ServerConfig):
    """The reward service's server: /metrics on by default, on a port of its own."""

    metrics_port: int = Field(default=METRICS_PORTS["reward"], ge=METRICS_OFF, le=65535)
    """Port of the Prometheus /metrics endpoint, bound on `host` (default 9102); 0 picks a free port
    (printed at start), -1 turns it off."""


class RewardServiceConfig(StrictModel):
    """The reward service: a batch scorer over gRPC."""

    server: RewardServerConfig = Field(default_factory=lambda: RewardServerConfig(port=50052))
    """gRPC server."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    item_timeout_s: float = Field(default=10.0, gt=0)
    """Default deadline per scored item when a request sets none."""
    max_batch_items: int = Field(default=4096, ge=1)
    """Largest batch accepted by Score; bigger ones get RESOURCE_EXHAUSTED."""
    max_item_bytes: int = Field(default=1 << 20, ge=1)
    """Largest single item (prompt + completion + reference + metadata); bigger gets RESOURCE_EXHAUSTED."""
    workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    """Scorer worker processes (CPU-heavy scorers run there, off the event loop); defaults to the cores.
    With several server `processes` they are shared out: each process gets ceil(workers / processes)."""
    processes: int = Field(default=1, ge=1, le=64)
    """Server processes sharing the port (SO_REUSEPORT, Linux): the kernel spreads client connections
    over them. One process handles RPCs on one core at most (gRPC's per-call work, the proto conversions
    and the inline scorers hold its GIL); raise this when cheap scorers at high call rates saturate it.
    Connections, not calls, are spread: a client reaches several processes only over several
    connections."""
    inline_scorers: list[str] = Field(
        default_factory=lambda: ["exact_match", "regex", "length_penalty", "overlong_penalty"]
    )
    """Cheap scorers run on a thread of the server process, where a process hop would cost more than the
    scoring itself."""
    token: str | None = Field(default=None, min_length=1)
    """Bearer token required on Score and ListScorers (health checks stay open); set it from
    RLFABRIC_REWARD__TOKEN. The process refuses to start without it unless `insecure`."""
    stall_timeout_s: float | None = Field(default=300.0, ge=10)
    """A process whose event loop does not turn for this long (a call that blocks it and never returns:
    every RPC waits behind it) writes every stack to its log and exits with code 75, so that whoever
    started it restarts it (`runtime.watchdog`). None: never."""
    insecure: bool = False
    """Serve without credentials (`rlfabric serve reward --insecure`): `token` is no longer required at
    start (when set it is still enforced) and a WARNING is logged. For tests and loopback only: without a
    token anyone who reaches the port can run the scorers."""
    allowed_functions: list[str] = Field(default_factory=list)
    """Where user code (`python_function`) may be loaded from; empty (the default) allows none. Each
    entry is a module prefix "pkg.sub" (it and its submodules), one function "pkg.mod:attr", or a
    directory (an entry holding a "/") whose .py files may be loaded, symlinks and ".." resolved first.
    Anything else is refused with INVALID_ARGUMENT before any import."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """The code sandbox's limits; requests may only tighten them."""
    judge_api_keys: dict[str, str] = Field(default_factory=dict)
    """Environment variables an `llm_judge` request may name in `api_key_env`, each mapped to the base
    URL its key may be sent to (the request's `base_url` must be that URL or below it), e.g.
    {"JUDGE_API_KEY": "https://judge.internal/v1"}. Empty (the default): no request may use a key, so a
    caller cannot send this process's environment to a URL of its choosing."""

    @field_validator("allowed_functions")
    @classmethod
    def _known_entry_kinds(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            allow_entry_kind(entry)
        return entries
