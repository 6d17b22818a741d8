"""A rollout replica on its own (`rlfabric serve rollout`, the transformers engine, no run, no Redis), as
the integration tests that load or hang one start it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlfabric.local.procs import ServiceProcess
from rlfabric.runtime import failpoints as failpoints_module


def start_replica(
    model: Path, log_path: Path, client_token: str, *settings: str, failpoints: str = ""
) -> tuple[ServiceProcess, str]:
    """A started replica serving `model` (version 0) with `client_token` and the `--set`s in `settings`
    (metrics off, text logs); the process and its address. Stop it with `stop()`."""
    argv = [
        sys.executable, "-m", "rlfabric.cli", "serve", "rollout", "--model", str(model),
        "--engine", "transformers", "--port", "0",
        "--set", "server.metrics_port=-1", "--set", "log.format=text",
    ]  # fmt: skip
    for setting in settings:
        argv += ["--set", setting]
    env = {
        **os.environ,
        "RLFABRIC_ROLLOUT__CLIENT_TOKEN": client_token,
        "RLFABRIC_ROLLOUT__LEARNER_TOKEN": "ln",
    }
    if failpoints:
        env[failpoints_module.ENV] = failpoints
    proc = ServiceProcess("rollout", argv, log_path=log_path, env=env)
    try:
        address = proc.start(r"listening on (\S+)", timeout_s=120).group(1)
        proc.wait_for(r"serving version 0", timeout_s=120)
    except BaseException:
        proc.stop()
        raise
    return proc, address
