"""`rlfabric serve environment`: the environment service process."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from rlfabric.environment.config import EnvironmentServiceConfig
from rlfabric.environment.loading import environment_factory
from rlfabric.environment.server import EnvironmentServicer
from rlfabric.environment.sessions import SessionLimits, SessionTable
from rlfabric.runtime.credentials import Credential, require_credentials
from rlfabric.runtime.grpc_server import GrpcServer, full_service_name, options_from_config
from rlfabric.runtime.logs import setup_logging
from rlfabric.runtime.metrics import serve_metrics
from rlfabric.runtime.telemetry import setup_tracing
from rlfabric.runtime.user_code import FunctionAllowlist
from rlfabric.runtime.watchdog import watch_event_loop
from rlfabric.v1 import environment_pb2, environment_pb2_grpc

log = logging.getLogger(__name__)
EXPIRY_INTERVAL_S = 5.0
"""How often idle sessions are looked for (at most; a short TTL is checked 4 times per TTL)."""


def session_table(config: EnvironmentServiceConfig) -> SessionTable:
    """The sessions of the configured environment, its code loaded now (a bad spec raises here)."""
    allowlist = FunctionAllowlist.parse(config.allowed_functions)
    factory = environment_factory(config.environment, allowlist, config.sandbox)
    limits = SessionLimits(config.max_sessions, config.session_ttl_s, config.step_timeout_s, config.max_steps)
    return SessionTable(factory, limits)


async def run(config: EnvironmentServiceConfig, table: SessionTable) -> None:
    """Serves until a signal stops the server; expires idle sessions meanwhile."""
    servicer = EnvironmentServicer(table, max_action_bytes=config.max_action_bytes, token=config.token)
    server = GrpcServer(options_from_config(config.server))
    server.add_servicer(
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server,
        servicer,
        full_service_name(environment_pb2, "EnvironmentService"),
    )
    port = await server.start()
    server.install_signal_handlers()
    log.info("environment service listening", extra={"port": port})
    print(f"rlfabric environment service listening on {config.server.host}:{port}", flush=True)
    expiry = asyncio.create_task(table.run_expiry(min(EXPIRY_INTERVAL_S, config.session_ttl_s / 4)))
    watchdog = await watch_event_loop(config.stall_timeout_s, "the environment service's event loop")
    try:
        await server.wait_for_termination()
    finally:
        if watchdog is not None:
            watchdog.stop()
        expiry.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await expiry


def serve(config: EnvironmentServiceConfig) -> int:
    """The service's entry: refuses to start without its token (unless insecure), then serves."""
    setup_logging("environment", config.log.level, config.log.format)
    require_credentials("environment", [Credential("token", config.token)], insecure=config.insecure)
    table = session_table(config)
    serve_metrics("environment", config.server)
    setup_tracing("rlfabric-environment")
    asyncio.run(run(config, table))
    return 0
