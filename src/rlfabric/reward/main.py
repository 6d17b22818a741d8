"""`rlfabric serve reward`: the reward service process (or, with `processes` > 1, their supervisor)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from rlfabric.reward.config import RewardServiceConfig
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.server import RewardServicer
from rlfabric.reward.service import RewardEngine
from rlfabric.runtime.credentials import Credential, require_credentials
from rlfabric.runtime.grpc_server import GrpcServer, full_service_name, options_from_config
from rlfabric.runtime.logs import setup_logging
from rlfabric.runtime.metrics import serve_metrics
from rlfabric.runtime.telemetry import setup_tracing
from rlfabric.runtime.watchdog import watch_event_loop
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)


async def run(
    config: RewardServiceConfig, *, reuse_port: bool = False, on_ready: Callable[[int], None] | None = None
) -> None:
    """Starts the worker pool and the gRPC server; returns after a graceful shutdown.

    Once bound, the port goes to `on_ready` (a supervised process) or is announced on stdout."""
    engine = RewardEngine(
        workers=config.workers,
        item_timeout_s=config.item_timeout_s,
        inline=config.inline_scorers,
        policy=ScorerPolicy.from_config(config),
    )
    await engine.start()
    servicer = RewardServicer(
        engine,
        max_batch_items=config.max_batch_items,
        max_item_bytes=config.max_item_bytes,
        token=config.token,
    )
    options = dataclasses.replace(options_from_config(config.server), reuse_port=reuse_port)
    server = GrpcServer(options)
    server.add_servicer(
        reward_pb2_grpc.add_RewardServiceServicer_to_server,
        servicer,
        full_service_name(reward_pb2, "RewardService"),
    )
    port = await server.start()
    server.install_signal_handlers()
    log.info("reward service listening", extra={"port": port, "workers": config.workers})
    if on_ready is not None:
        on_ready(port)
    else:
        print(f"rlfabric reward service listening on {config.server.host}:{port}", flush=True)
    watchdog = await watch_event_loop(config.stall_timeout_s, "the reward service's event loop")
    try:
        await server.wait_for_termination()
    finally:
        if watchdog is not None:
            watchdog.stop()
        await engine.close()


def serve(config: RewardServiceConfig) -> int:
    """The service's entry: refuses to start without its token (unless insecure), then serves."""
    setup_logging("reward", config.log.level, config.log.format)
    require_credentials("reward", [Credential("token", config.token)], insecure=config.insecure)
    if config.processes > 1:
        from rlfabric.reward.supervisor import supervise

        return supervise(config)
    serve_metrics("reward", config.server)
    serve_one(config)
    return 0


def serve_one(
    config: RewardServiceConfig, *, reuse_port: bool = False, on_ready: Callable[[int], None] | None = None
) -> None:
    """One server process in the foreground (the whole service, or one of a supervisor's children)."""
    setup_logging("reward", config.log.level, config.log.format)
    setup_tracing("rlfabric-reward")
    asyncio.run(run(config, reuse_port=reuse_port, on_ready=on_ready))
