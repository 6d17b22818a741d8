"""Configuration of the learner process (`rlfabric serve learner`, usually under torchrun)."""

from __future__ import annotations

from pydantic import Field

from rlfabric.runspec import RunSpec
from rlfabric.runtime.config import StrictModel
from rlfabric.runtime.schema import METRICS_OFF, METRICS_PORTS, LogConfig, RedisConfig, ServerConfig


class LearnerServerConfig(ServerConfig):
    """The learner service's server: /metrics on by default, on a port of its own."""

    metrics_port: int = Field(default=METRICS_PORTS["learner"], ge=METRICS_OFF, le=65535)
    """Port of the Prometheus /metrics endpoint, bound on `host` (default 9103); 0 picks a free port
    (printed at start), -1 turns it off."""


class LearnerServiceConfig(StrictModel):
    """The learner: trains on scored groups from the run's stream and publishes weights."""

    server: LearnerServerConfig = Field(default_factory=lambda: LearnerServerConfig(port=50053))
    """gRPC server of rank 0 (LearnerService.GetStatus)."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    redis: RedisConfig = Field(default_factory=RedisConfig)
    """Where the run's streams live."""
    run_id: str
    """The run to train (its Redis keys are `rlfabric:{run_id}:*`, see `rlfabric.contracts.keys`)."""
    run: RunSpec
    """The run spec (the same file the coordinator was given)."""
    consumer_name: str | None = None
    """Consumer name in the stream's consumer group; defaults to learner-<hostname>. Keep it stable across
    restarts: a restarted learner first re-reads the entries it had not acknowledged."""
    max_deliveries: int = Field(default=3, ge=1)
    """An entry delivered this many times without being applied goes to the dead-letter stream."""
    claim_idle_ms: int = Field(default=600_000, ge=1000)
    """Pending entries idle this long are reclaimed from a dead consumer (XAUTOCLAIM). Must exceed the
    longest time an entry legitimately stays unacknowledged: checkpoint_every steps plus a checkpoint."""
    rollout_addresses: list[str] = Field(default_factory=list)
    """Replicas to notify of new versions directly (the coordinator does it when empty)."""
    publish_token: str | None = Field(default=None, min_length=1)
    """Bearer token presented on UpdateWeights (the replicas' `learner_token`); set it from
    RLFABRIC_LEARNER__PUBLISH_TOKEN."""
    token: str | None = Field(default=None, min_length=1)
    """Bearer token required on LearnerService.GetStatus; set it from RLFABRIC_LEARNER__TOKEN. The process
    refuses to start without it unless `insecure` (offline preference mode serves no API and needs none)."""
    report_to_redis: bool = False
    """Offline preference runs only: report through Redis as the online learner does (each step's metrics
    row, `keys.step` and `keys.version`, the end of the data in `keys.learner_done`) and stop when the
    coordinator asks, so a run submitted to a coordinator shows and ends the same way. `rlfabric up` sets
    it; an offline run on its own (no coordinator) leaves it off and needs no Redis."""
    compute_lock: str | None = None
    """A file whose exclusive lock the learner holds while it trains each step (`learner.core_lock`):
    learners sharing cores take turns instead of being time-sliced. `rlfabric up --learner-cores` gives the
    learners of one core list the same file; None (default) trains without it."""
    stall_timeout_s: float | None = Field(default=1800.0, ge=10)
    """A learner whose training loop makes no progress for this long (no read of the run's stream, no
    forward pass, no checkpoint or publish finished) writes every stack to its log and exits with code 75,
    so that whoever started it restarts it and it resumes from its last checkpoint
    (`runtime.watchdog`). A learner waiting for groups shows progress every 5 s or so. Set it above your
    longest checkpoint or weight publish; None: never."""
    insecure: bool = False
    """Serve without credentials (`rlfabric serve learner --insecure`): `token` is no longer required at
    start (when set it is still enforced) and a WARNING is logged. For tests and loopback only."""
