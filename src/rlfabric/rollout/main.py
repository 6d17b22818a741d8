"""`rlfabric serve rollout`: one replica — an engine, its gRPC server, its registry entry, its metrics.

Start-up order keeps the lifecycle guarantee: the gRPC server starts first with health NOT_SERVING (so
probes and the registry can see the replica starting), then the engine loads, then the latest committed
version of the run (or the base model as version 0), and only then does health say SERVING.

A run that trains a LoRA adapter publishes adapter versions to its weights root: a replica bound to it
(`run_id`) then serves the base as version 0 and loads each of the run's versions as the adapter named
after the run (`engine.max_adapters` must be > 0), at start and as the learner announces them. A replica
of a shared fleet (`fleet`) is bound to no run: it registers under the fleet's scope, serves the base as
version 0 and loads the adapter versions of the fleet's member runs as they are announced
(`rollout.fleet`).

Shutdown drains (SIGTERM, as on scale-in): the replica admits nothing new and says `draining` in the
registry at once, so the coordinator stops dispatching to it; its admitted requests finish (up to
`drain_timeout_s`); then the gRPC server stops and the registry entry is deleted. Nothing is re-dispatched
that the replica could finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Info

from rlfabric.contracts import keys
from rlfabric.contracts.registry import Heartbeat, ReplicaEntry
from rlfabric.rollout.config import EngineConfig, RolloutServiceConfig
from rlfabric.rollout.engine import Engine
from rlfabric.rollout.fleet import follow_fleet
from rlfabric.rollout.replica import Limits, Replica
from rlfabric.rollout.server import RolloutServicer
from rlfabric.rollout.weights_source import WeightsSource
from rlfabric.runtime import hardware
from rlfabric.runtime.addresses import announced_address
from rlfabric.runtime.config import ConfigError
from rlfabric.runtime.credentials import Credential, require_credentials
from rlfabric.runtime.grpc_server import GrpcServer, full_service_name, options_from_config
from rlfabric.runtime.logs import setup_logging
from rlfabric.runtime.metrics import serve_metrics
from rlfabric.runtime.telemetry import setup_tracing
from rlfabric.runtime.watchdog import Watchdog, watch_event_loop
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from rlfabric.weights.adapters import run_adapter_name

if TYPE_CHECKING:
    from rlfabric.environment.client import AsyncEnvironmentClient

log = logging.getLogger(__name__)
SERVICE = full_service_name(rollout_pb2, "RolloutService")

_INFO = Info("rlfabric_rollout", "The replica's identity")
_VERSION = Gauge("rlfabric_rollout_policy_version", "Policy version serving now (-1 before the first)")
_IN_FLIGHT = Gauge("rlfabric_rollout_in_flight_prompts", "Admitted prompts not yet finished")
_RUNNING = Gauge("rlfabric_rollout_engine_running", "Sequences the engine is generating")
_WAITING = Gauge("rlfabric_rollout_engine_waiting", "Sequences waiting in the engine")
_KV = Gauge("rlfabric_rollout_kv_cache_usage_ratio", "Share (0-1) of the KV cache in use")
_BUSY = Gauge("rlfabric_rollout_busy_ratio", "Share (0-1) of the time since start with work in the engine")
_TOKENS = Counter("rlfabric_rollout_generated_tokens_total", "Completion tokens generated")
_LOAD = Gauge("rlfabric_rollout_last_weight_load_seconds", "Duration of the last weight load")


def resolve_dtype(dtype: str) -> str:
    """ "auto" is bfloat16 where the device computes it natively and float32 elsewhere
    (`rlfabric.runtime.hardware.auto_dtype`; vLLM's own "auto" would downcast float32 checkpoints to
    bfloat16 on any CPU, even one that only emulates it). An explicit bfloat16 where it is not native logs
    a warning."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = hardware.auto_dtype(device) if dtype == "auto" else dtype
    warning = hardware.bfloat16_warning(name, device)
    if warning:
        log.warning("dtype: %s", warning)
    return name


def resolve_worker_wait(wait: str) -> str:
    """ "auto" is spin on a GPU and block on a CPU (see `rlfabric.rollout.vllm_executor`)."""
    if wait != "auto":
        return wait
    import torch

    return "spin" if torch.cuda.is_available() else "block"


def build_engine(config: EngineConfig) -> Engine:
    dtype = resolve_dtype(config.dtype)
    if config.kind == "transformers":
        from rlfabric.rollout.hf_engine import HfEngine

        return HfEngine(
            config.model,
            dtype=dtype,
            max_model_len=config.max_model_len,
            seed=config.seed,
            batch_prompts=config.batch_prompts,
        )
    from rlfabric.rollout.vllm_engine import VllmEngine

    return VllmEngine(
        config.model,
        dtype=dtype,  # type: ignore[arg-type]
        max_model_len=config.max_model_len,
        kv_cache_bytes=config.kv_cache_bytes,
        block_size=config.block_size,
        enforce_eager=config.enforce_eager,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed,
        worker_wait=resolve_worker_wait(config.worker_wait),  # type: ignore[arg-type]
        max_adapters=config.max_adapters,
        max_adapter_rank=config.max_adapter_rank,
    )


@dataclass
class Parts:
    """Everything one replica process runs, so start-up and shutdown read as a list of steps."""

    config: RolloutServiceConfig
    engine: Engine
    replica: Replica
    weights: WeightsSource
    server: GrpcServer
    replica_id: str = ""
    address: str = ""
    heartbeat: Heartbeat | None = None
    servicer: RolloutServicer | None = None
    redis: Any = None

    def adapter_versions(self) -> dict[str, int]:
        """The adapters the replica serves: name -> version."""
        return {slot.name: slot.version or 0 for slot in self.replica.adapters.all()}

    def entry(self) -> ReplicaEntry:
        return ReplicaEntry(
            replica_id=self.replica_id,
            address=self.address,
            version=self.replica.version if self.replica.version is not None else -1,
            serving=self.replica.serving,
            in_flight=self.replica.in_flight,
            capacity=self.replica.limits.max_in_flight,
            model=self.config.engine.model,
            engine=self.engine.kind,
            draining=self.replica.draining,
            adapters=ReplicaEntry.encode_adapters(self.adapter_versions()),
        )


def assemble(config: RolloutServiceConfig) -> Parts:
    engine = build_engine(config.engine)
    log.info("engine: %s, %s", engine.kind, config.engine.model)
    limits = Limits(
        max_in_flight=config.max_in_flight,
        max_n=config.max_n,
        max_tokens=config.max_tokens,
        max_prompts=config.max_prompts_per_request,
        min_version_wait_s=config.min_version_wait_s,
    )
    replica = Replica(engine, limits)
    if config.run_id and config.engine.max_adapters:
        replica.awaited_adapter = run_adapter_name(config.run_id)
    weights = WeightsSource(engine, base_model_dir=config.engine.model, root_url=config.weights_root)
    return Parts(config, engine, replica, weights, GrpcServer(options_from_config(config.server)))


async def start_server(parts: Parts) -> None:
    config = parts.config
    port_holder: dict[str, Any] = {}

    async def on_serving_change(serving: bool) -> None:
        await parts.server.set_serving(SERVICE, serving)
        await parts.server.set_serving("", serving)

    servicer = RolloutServicer(
        parts.replica,
        parts.weights,
        replica_id="(starting)",
        address="",
        model=config.engine.model,
        learner_token=config.learner_token,
        client_token=config.client_token,
        update_timeout_s=config.update_timeout_s,
        on_serving_change=on_serving_change,
        environment=environment_client(config),
    )
    parts.servicer = servicer
    parts.server.add_servicer(
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer, SERVICE, serving=False
    )
    port_holder["port"] = await parts.server.start()
    await parts.server.set_serving("", False)
    parts.address = announced_address(config.server.host, port_holder["port"], config.advertise_address)
    parts.replica_id = config.replica_id or f"{socket.gethostname()}-{port_holder['port']}"
    servicer.replica_id, servicer.address = parts.replica_id, parts.address
    log.info("bound %s port %d; announced as %s", config.server.host, port_holder["port"], parts.address)
    print(f"rlfabric rollout replica {parts.replica_id} listening on {parts.address}", flush=True)


def environment_client(config: RolloutServiceConfig) -> AsyncEnvironmentClient | None:
    """The environment service's client when one is configured (inside the running event loop)."""
    env = config.environment
    if env is None:
        return None
    from rlfabric.environment.client import AsyncEnvironmentClient

    return AsyncEnvironmentClient(env.address, timeout_s=env.timeout_s, token=env.token)


async def load_initial_weights(parts: Parts) -> None:
    """The latest committed version of the run, else the base model as version 0; a run's adapter version
    is loaded as its adapter beside the base (version 0)."""
    await parts.engine.start()
    latest = await parts.weights.latest()
    run_adapter = latest if latest and await parts.weights.holds_adapter(latest) else None
    base = 0 if run_adapter else (latest or 0)
    if base:
        path = await parts.weights.stage(parts.weights.root_url or "", base)
        await parts.engine.load_weights_dir(path)
        await parts.engine.reset_prefix_cache()
        parts.weights.serving_dir = path
    parts.replica.start_serving(base, parts.weights.restore_loader())
    if run_adapter:
        await load_run_adapter(parts, run_adapter)
    await parts.server.set_serving(SERVICE, True)
    await parts.server.set_serving("", True)
    adapter = (
        f" with adapter {run_adapter_name(parts.config.run_id or '')} version {run_adapter}"
        if run_adapter
        else ""
    )
    print(f"rlfabric rollout replica {parts.replica_id} serving version {base}{adapter}", flush=True)


async def load_run_adapter(parts: Parts, version: int) -> None:
    """Loads the run's adapter version `version` from the weights root, as the adapter named `run_id`."""
    assert parts.servicer is not None
    if not parts.config.run_id:
        raise ConfigError("weights_root holds LoRA adapter versions: set run_id, the adapter's name")
    request = rollout_pb2.UpdateWeightsRequest(
        version=version,
        adapter=run_adapter_name(parts.config.run_id),
        object_store=rollout_pb2.ObjectStoreSource(),
    )
    await parts.servicer.update(request)
    log.info("serving adapter %s version %d", run_adapter_name(parts.config.run_id), version)


def run_version(parts: Parts) -> int:
    """The run's version this replica serves: its adapter's when it holds the run's adapter."""
    slot = parts.replica.adapters.get(run_adapter_name(parts.config.run_id or ""))
    if slot is not None and slot.version is not None:
        return slot.version
    return parts.replica.version or 0


async def start_heartbeat(parts: Parts) -> None:
    """Registers the replica in Redis (when configured) and keeps the entry alive."""
    if parts.config.redis is None:
        return
    import redis.asyncio as aioredis

    parts.redis = aioredis.Redis.from_url(
        parts.config.redis.url, socket_timeout=parts.config.redis.socket_timeout_s
    )
    scope = registry_scope(parts.config)
    parts.heartbeat = Heartbeat(parts.redis, scope, parts.entry, parts.config.heartbeat_s)
    await parts.heartbeat.start()


def registry_scope(config: RolloutServiceConfig) -> str | None:
    """Where the replica registers: its fleet's scope, else its run (None: unbound)."""
    return keys.fleet_scope(config.fleet) if config.fleet else config.run_id


async def follow_versions(parts: Parts) -> None:
    """Loads each version the learner announces in `keys.version` from the run's object store (an adapter
    version as the run's adapter). A version that fails (it does not verify, it was pruned) is skipped
    until a newer one is announced."""
    assert parts.servicer is not None and parts.redis is not None and parts.config.run_id
    key, failed = keys.version(parts.config.run_id), -1
    while True:
        await asyncio.sleep(parts.config.version_poll_s)
        try:
            announced = int(await parts.redis.get(key) or 0)
        except Exception:  # tolerated: Redis may be restarting; retried at the next poll
            log.warning("could not read the announced version", exc_info=True)
            continue
        if announced <= run_version(parts) or announced == failed:
            continue
        try:
            await load_announced(parts, announced)
        except Exception:  # tolerated and counted in the log: the old version keeps serving
            failed = announced
            log.exception("could not load announced version %s; the old version keeps serving", announced)


async def load_announced(parts: Parts, version: int) -> None:
    """Loads an announced version of the run: as its adapter, or as the full weights."""
    assert parts.servicer is not None
    if await parts.weights.holds_adapter(version):
        await load_run_adapter(parts, version)
        return
    request = rollout_pb2.UpdateWeightsRequest(version=version, object_store=rollout_pb2.ObjectStoreSource())
    await parts.servicer.apply(request)


async def export_metrics(parts: Parts) -> None:
    _INFO.info({"model": parts.config.engine.model, "engine": parts.engine.kind, "replica": parts.replica_id})
    counted = 0
    while True:
        stats = parts.engine.stats()
        _VERSION.set(parts.replica.version if parts.replica.version is not None else -1)
        _IN_FLIGHT.set(parts.replica.in_flight)
        _RUNNING.set(stats.running)
        _WAITING.set(stats.waiting)
        _KV.set(stats.kv_cache_usage)
        _BUSY.set(parts.replica.busy_fraction())
        _LOAD.set(parts.replica.last_load_s)
        _TOKENS.inc(parts.replica.tokens_generated - counted)
        counted = parts.replica.tokens_generated
        await asyncio.sleep(1.0)


def install_drain_on_signal(parts: Parts) -> None:
    """SIGTERM and SIGINT start `drain_and_stop` once; a repeated signal is ignored."""
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s: draining", sig.name)
        if not stopping:
            stopping.append(loop.create_task(drain_and_stop(parts)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


async def drain_and_stop(parts: Parts) -> None:
    """1. admit nothing new; 2. announce `draining` in the registry now (not at the next beat); 3. let the
    admitted requests finish, up to `drain_timeout_s`; 4. stop the server (its grace cancels the rest)."""
    parts.replica.start_draining()
    if parts.heartbeat is not None:
        try:
            await parts.heartbeat.beat()
        except Exception:  # tolerated: Redis unreachable; the entry expires with its TTL instead
            log.warning("could not announce draining in the registry", exc_info=True)
    idle = await parts.replica.wait_idle(parts.config.drain_timeout_s)
    if not idle:
        log.warning("drain timed out with %d prompts in flight", parts.replica.in_flight)
    await parts.server.stop()


async def run(config: RolloutServiceConfig) -> None:
    parts = assemble(config)
    await start_server(parts)
    install_drain_on_signal(parts)
    tasks = [asyncio.get_running_loop().create_task(export_metrics(parts))]
    loop_watchdog = None
    try:
        await load_initial_weights(parts)
        await start_heartbeat(parts)
        loop_watchdog = await start_watchdogs(parts)
        follower = follower_of(parts)
        if follower is not None:
            tasks.append(asyncio.get_running_loop().create_task(follower))
        await parts.server.wait_for_termination()
    finally:
        parts.replica.watchdog.stop()
        if loop_watchdog is not None:
            loop_watchdog.stop()
        for task in tasks:
            task.cancel()
        if parts.heartbeat is not None:
            with contextlib.suppress(Exception):
                await parts.heartbeat.stop()
        await parts.engine.close()
        parts.weights.close()


async def start_watchdogs(parts: Parts) -> Watchdog | None:
    """`stall_timeout_s`: ends a replica whose engine finishes no sample for that long while prompts are
    in flight, or, while none is, whose event loop does not turn for that long (a blocked loop admits no
    request, so nothing would ever be in flight); its supervisor restarts it (`runtime.watchdog`). One of
    the two counts at a time: a loop blocked with prompts in flight is the engine's watchdog's. Returns
    the event loop's watchdog, to stop."""
    timeout, replica = parts.config.stall_timeout_s, parts.replica
    if timeout is None:
        return None
    replica.watchdog = Watchdog(
        timeout, "the replica's engine", loop=asyncio.get_running_loop(), busy=lambda: replica.in_flight > 0
    ).start()
    return await watch_event_loop(timeout, "the replica's event loop", busy=lambda: replica.in_flight == 0)


def follower_of(parts: Parts) -> Coroutine[Any, Any, None] | None:
    """The loop that follows what the replica is bound to: its fleet's members, or its run's versions."""
    config = parts.config
    if parts.redis is None:
        return None
    if config.fleet:
        return follow_fleet(parts)
    if config.run_id and config.weights_root:
        return follow_versions(parts)
    return None


def check_template_for_environment(config: RolloutServiceConfig) -> None:
    """A replica that plays multi-turn trajectories refuses to start when its model's chat template
    fails the self-test (`rollout.chat_template`): it would train on ids the template does not render."""
    if config.environment is None:
        return
    from transformers import AutoTokenizer

    from rlfabric.rollout.chat_template import multi_turn_self_test, renders_tools

    tokenizer = AutoTokenizer.from_pretrained(config.engine.model)
    mismatch = multi_turn_self_test(tokenizer, with_tools=renders_tools(tokenizer))
    if mismatch is not None:
        raise ConfigError(f"engine.model: the chat template fails the multi-turn self-test: {mismatch}")
    log.info("chat template self-test passed (multi-turn)")


def credentials(config: RolloutServiceConfig) -> list[Credential]:
    """The tokens a replica needs: the learner's (UpdateWeights) and its clients' (Generate, GetInfo)."""
    return [
        Credential("learner_token", config.learner_token),
        Credential("client_token", config.client_token),
    ]


def serve(config: RolloutServiceConfig) -> int:
    """The replica's entry: refuses to start without its tokens (unless insecure), or with a chat template
    a multi-turn environment cannot use, then serves."""
    setup_logging("rollout", config.log.level, config.log.format)
    require_credentials("rollout", credentials(config), insecure=config.insecure)
    check_template_for_environment(config)
    setup_tracing("rlfabric-rollout")
    serve_metrics("rollout", config.server)
    asyncio.run(run(config))
    return 0
