"""`rlfabric serve coordinator`: the REST API and the run pipelines, in one asyncio process."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.runtime.credentials import Credential, require_credentials
from rlfabric.runtime.logs import setup_logging
from rlfabric.runtime.telemetry import setup_tracing

log = logging.getLogger(__name__)


def credentials(config: CoordinatorServiceConfig) -> list[Credential]:
    """The tokens the coordinator needs: its API's, the reward service's, the rollout replicas' and, when it
    calls the learner's status API, the learner's."""
    needed = [
        Credential("api.token", config.api.token),
        Credential("reward_token", config.reward_token),
        Credential("rollout_token", config.rollout_token),
    ]
    if config.learner_address is not None:
        needed.append(Credential("learner_token", config.learner_token))
    return needed


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound before uvicorn starts so port 0 can be reported."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


async def run(config: CoordinatorServiceConfig) -> None:
    import uvicorn

    from rlfabric.coordinator.api import create_app
    from rlfabric.coordinator.checks import SubmitCheck, preload
    from rlfabric.coordinator.manager import RunManager
    from rlfabric.runtime.watchdog import watch_event_loop

    watchdog = await watch_event_loop(config.stall_timeout_s, "the coordinator's event loop")
    redis = config.redis.connect()
    manager = RunManager(config, redis)
    check = SubmitCheck(config) if config.checks.on_submit else None
    app = create_app(config, redis, on_submit=manager.on_submit, on_stop=manager.on_stop, check=check)
    sock = bind(config.api.host, config.api.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    await manager.resume()
    host, port = sock.getsockname()[:2]
    print(f"rlfabric coordinator listening on http://{host}:{port}", flush=True)
    if check is not None:
        threading.Thread(target=preload, name="preload-checks", daemon=True).start()
    try:
        await server.serve(sockets=[sock])
    finally:
        await manager.close()
        await redis.aclose()
        if watchdog is not None:
            watchdog.stop()


def serve(config: CoordinatorServiceConfig) -> int:
    """The service's entry: refuses to start without its tokens (unless insecure), then serves."""
    setup_logging("coordinator", config.log.level, config.log.format)
    require_credentials("coordinator", credentials(config), insecure=config.insecure)
    setup_tracing("rlfabric-coordinator")
    asyncio.run(run(config))
    return 0
