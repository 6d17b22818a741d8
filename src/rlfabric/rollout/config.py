"""Configuration of a rollout replica (`rlfabric serve rollout`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlfabric.runspec import RUN_NAME_PATTERN
from rlfabric.runtime.addresses import check_advertise_address, is_wildcard
from rlfabric.runtime.config import StrictModel
from rlfabric.runtime.schema import METRICS_OFF, METRICS_PORTS, LogConfig, RedisConfig, ServerConfig

AdapterRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The LoRA ranks vLLM can reserve adapter slots for (`vllm.config.lora.MaxLoRARanks`)."""


class EngineConfig(StrictModel):
    """The generation engine."""

    kind: Literal["vllm", "transformers"] = "vllm"
    """vllm in production; transformers is the small reference engine (no vLLM needed)."""
    model: str
    """Local folder or hub id of the base model (policy version 0)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype: auto is bfloat16 where the device computes it natively (a GPU with bfloat16, a CPU
    with AMX, or with AVX-512 BF16 where a probe measures bfloat16 faster) and float32 elsewhere
    (`rlfabric.runtime.hardware`); bfloat16 where it is not native warns."""
    max_model_len: int = Field(default=2048, ge=16)
    """Longest prompt + completion in tokens."""
    kv_cache_bytes: int = Field(default=1 << 30, ge=1 << 20)
    """KV cache size (vLLM on CPU needs it explicitly)."""
    block_size: int | None = Field(default=None, ge=16, le=1024)
    """Tokens per KV-cache block; None keeps vLLM's (128 on CPU, 16 on GPU). The prefix cache reuses whole
    blocks only, so multi-turn trajectories with short turns hit it more with smaller blocks (on CPU a
    multiple of 32)."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: starts faster, generates slower."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may use (GPU only)."""
    seed: int = 0
    """Engine seed."""
    worker_wait: Literal["auto", "spin", "block"] = "auto"
    """How vLLM's engine core and model worker wait for each other: `spin` polls (shortest wait: right when
    the worker computes on a GPU), `block` sleeps until the message arrives (on a CPU the spinning takes
    cycles from the worker's threads on the same cores), re-reading the queue at most every half of the
    time waited so far (1 ms to 1 s), so a lost wake-up costs milliseconds, not vLLM's 5 s; auto is block
    on CPU, spin on GPU."""
    max_adapters: int = Field(default=0, ge=0, le=256)
    """LoRA adapters the replica may hold at once beside the base model (vLLM's `max_loras`: the adapters
    one engine step can mix); 0 turns LoRA off (adapter requests get FAILED_PRECONDITION). Loading a new
    adapter name while all are held gets RESOURCE_EXHAUSTED: none is evicted. LoRA needs the vllm engine;
    on CPU vLLM then runs the model without compilation."""
    max_adapter_rank: AdapterRank = 16
    """Largest LoRA rank r an adapter may have (vLLM's `max_lora_rank`, one of the ranks vLLM supports):
    an adapter of a higher rank is refused with FAILED_PRECONDITION. Memory for the adapters' weights is
    reserved at this rank for every slot, so keep it at the runs' rank."""

    batch_prompts: int = Field(default=1, ge=1, le=1024)
    """transformers engine only: prompts of concurrent requests with the same sampling settings (and no
    seed) are generated together, left-padded, up to this many per `generate` call; 1 runs prompt after
    prompt. vLLM batches continuously by itself."""

    @model_validator(mode="after")
    def _batching_is_transformers(self) -> EngineConfig:
        if self.batch_prompts > 1 and self.kind != "transformers":
            raise ValueError(f"batch_prompts: only the transformers engine takes it, not {self.kind!r}")
        return self

    @model_validator(mode="after")
    def _lora_needs_vllm(self) -> EngineConfig:
        if self.max_adapters and self.kind != "vllm":
            raise ValueError(f"max_adapters: LoRA adapters need engine.kind 'vllm', not {self.kind!r}")
        return self


class EnvironmentConnection(StrictModel):
    """The environment service multi-turn requests play against (`GenerateRequest.multi_turn`)."""

    address: str
    """host:port of the environment service."""
    token: str | None = Field(default=None, min_length=1)
    """Its bearer token; set it from RLFABRIC_ROLLOUT__ENVIRONMENT__TOKEN, not a file."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of each Reset/Step call: keep it above the service's own step timeout, so that a slow
    environment answers TIMEOUT (a trajectory status) rather than the call failing."""


class RolloutServerConfig(ServerConfig):
    """The rollout service's server: /metrics on by default, on a port of its own."""

    metrics_port: int = Field(default=METRICS_PORTS["rollout"], ge=METRICS_OFF, le=65535)
    """Port of the Prometheus /metrics endpoint, bound on `host` (default 9101); 0 picks a free port
    (printed at start), -1 turns it off."""


class RolloutServiceConfig(StrictModel):
    """A rollout replica: one engine behind the RolloutService gRPC API."""

    server: RolloutServerConfig = Field(default_factory=lambda: RolloutServerConfig(port=50051))
    """gRPC server."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    engine: EngineConfig
    """The engine and model."""
    advertise_address: str | None = None
    """host or host:port that clients reach this replica at: what it registers in the Redis registry and
    reports in GetInfo (without a port, the bound one). Unset, it is `server.host`; set it when the replica
    binds every interface (0.0.0.0 or ::, where it is required) or sits behind NAT (RLFABRIC_ROLLOUT__
    ADVERTISE_ADDRESS, e.g. the pod IP)."""
    replica_id: str | None = None
    """Stable id of this replica; defaults to <hostname>-<port>."""
    max_in_flight: int = Field(default=256, ge=1)
    """Admitted prompts not yet finished; Generate past it gets RESOURCE_EXHAUSTED."""
    stall_timeout_s: float | None = Field(default=1800.0, ge=10)
    """A replica with prompts in flight whose engine finishes no sample for this long (a hung engine)
    writes every stack to its log and exits with code 75, so that whoever started it restarts it; the
    coordinator sends its requests elsewhere (`runtime.watchdog`). Set it above the time your longest
    sample takes; None: never."""
    max_prompts_per_request: int = Field(default=256, ge=1)
    """Prompts one Generate request may carry."""
    max_n: int = Field(default=64, ge=1)
    """Largest `sampling.n` accepted."""
    max_tokens: int = Field(default=4096, ge=1)
    """Largest `sampling.max_tokens` accepted (also bounded by the model's context)."""
    weights_root: str | None = None
    """fsspec URL of the run's published weights; at start the replica loads the latest committed
    version there (else it serves the base model as version 0), and object-store updates default to it."""
    run_id: str | None = None
    """Run whose registry and weights this replica follows; None serves the base model only."""
    fleet: str | None = Field(default=None, pattern=RUN_NAME_PATTERN)
    """The shared rollout fleet this replica belongs to (the runs' `rollout.fleet`), instead of one run: it
    registers under the fleet's scope, serves the base model as version 0 and follows the fleet's members
    (`contracts.fleet`), loading each member's announced adapter versions from the member's weights root
    and unloading the adapter of a run that left. Excludes `run_id` and `weights_root`; needs
    `engine.max_adapters` > 0 and `redis`."""
    redis: RedisConfig | None = None
    """Registry: replicas register here with a heartbeat TTL. None disables registration."""
    version_poll_s: float = Field(default=0.1, gt=0)
    """How often a replica bound to a run checks the learner's announced version (and loads it), and a
    fleet replica its fleet's members and their announced versions."""
    heartbeat_s: float = Field(default=2.0, gt=0)
    """Registry heartbeat interval; the entry expires after three missed beats."""
    learner_token: str | None = Field(default=None, min_length=1)
    """Bearer token required on UpdateWeights (the learner's `publish_token`); set it from
    RLFABRIC_ROLLOUT__LEARNER_TOKEN, not a file. The process refuses to start without it unless
    `insecure`."""
    client_token: str | None = Field(default=None, min_length=1)
    """Bearer token required on Generate and GetInfo, every RPC but UpdateWeights (health and reflection
    stay open): what the coordinator (its `rollout_token`) and other generation clients present; set it
    from RLFABRIC_ROLLOUT__CLIENT_TOKEN, not a file. It does not authorise UpdateWeights. The process
    refuses to start without it unless `insecure`."""
    update_timeout_s: float = Field(default=120.0, gt=0)
    """Default limit on a whole weight update."""
    drain_timeout_s: float = Field(default=20.0, ge=0)
    """On SIGTERM (scale-in) the replica stops taking work, marks itself draining in the registry and lets
    its admitted requests finish for up to this long before the server stops (then `server.grace_period_s`
    more before the rest is cancelled): whoever stops it should wait longer than the two together."""
    min_version_wait_s: float = Field(default=30.0, gt=0)
    """A Generate request with `min_policy_version` above the serving version waits this long for it
    (a replica bound to a run loads each announced version), then fails with FAILED_PRECONDITION; so does
    a request on the adapter of the replica's run, or of a member of its fleet, before it has loaded."""
    environment: EnvironmentConnection | None = None
    """The environment service of multi-turn requests; None refuses them (FAILED_PRECONDITION)."""
    insecure: bool = False
    """Serve without credentials (`rlfabric serve rollout --insecure`): `learner_token` and `client_token`
    are no longer required at start (those set are still enforced) and a WARNING is logged. For tests and
    loopback only: without the tokens anyone who reaches the port can replace the weights, or generate on
    the replica's accelerator and read its model's outputs."""

    @field_validator("advertise_address")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        return None if value is None else check_advertise_address(value)

    @model_validator(mode="after")
    def _announceable(self) -> RolloutServiceConfig:
        if self.advertise_address is None and is_wildcard(self.server.host):
            raise ValueError(
                f"server.host {self.server.host!r} binds every interface, which no client can dial: set "
                "advertise_address (RLFABRIC_ROLLOUT__ADVERTISE_ADDRESS) to the address clients reach"
            )
        return self

    @model_validator(mode="after")
    def _fleet_alone(self) -> RolloutServiceConfig:
        if self.fleet is None:
            return self
        for name in ("run_id", "weights_root"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}: a fleet replica (fleet={self.fleet!r}) follows its fleet's runs and their "
                    f"weights roots; unset {name}"
                )
        if not self.engine.max_adapters:
            raise ValueError(
                f"fleet: a fleet replica serves its runs' LoRA adapters: set engine.max_adapters > 0 "
                f"(fleet={self.fleet!r})"
            )
        if self.redis is None:
            raise ValueError("fleet: a fleet replica reads its fleet's members from Redis: set redis.url")
        return self
