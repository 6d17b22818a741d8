"""Configuration of the reward service process (`rlfabric serve reward`)."""

from __future__ import annotations

import os

from pydantic import Field

from rlfabric.common.config import StrictModel
from rlfabric.common.schema import LogConfig, ServerConfig


class RewardServiceConfig(StrictModel):
    """The reward service: a batch scorer over gRPC."""

    server: ServerConfig = Field(default_factory=lambda: ServerConfig(port=50052))
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
    insecure: bool = False
    """Serve without credentials (`rlfabric serve reward --insecure`): `token` is no longer required at
    start (when set it is still enforced) and a WARNING is logged. For tests and loopback only: without a
    token anyone who reaches the port can run the scorers."""
