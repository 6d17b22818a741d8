"""Configuration of the reward service process (`rlfabric serve reward`)."""

from __future__ import annotations

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
    workers: int = Field(default=4, ge=1)
    """Threads that run CPU-bound scorers concurrently."""
