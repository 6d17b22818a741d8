"""`rlfabric serve learner`: one learner rank (run it under torchrun for several).

The process entry: logging, credentials, tracing, the process group, then the service's training loop
(`loop.TrainingLoop`, every rank; rank 0's I/O is `leader.Leader`). `run.mode = "offline_preference"`,
`"sft"` and `"reward_model"` run `offline.py` instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import NoReturn

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.dist import destroy_distributed, exit_rank, init_distributed, leave_together
from rlfabric.learner.loop import TrainingLoop
from rlfabric.learner.tracking import require_trackers
from rlfabric.learner.trainer import Trainer
from rlfabric.runtime.credentials import Credential, require_credentials
from rlfabric.runtime.logs import setup_logging
from rlfabric.runtime.metrics import serve_metrics
from rlfabric.runtime.telemetry import setup_tracing

log = logging.getLogger(__name__)


def serve(config: LearnerServiceConfig) -> NoReturn:
    """Run this rank of the learner to the end of the run, then end the process with 0 (`exit_rank`); a
    failure raises."""
    require_trackers(config.run.tracking)  # a missing tracker package fails before any model loads
    if config.run.mode in ("offline_preference", "sft", "reward_model"):
        from rlfabric.learner.offline import serve_offline

        serve_offline(config)
    setup_logging("learner", config.log.level, config.log.format)
    require_credentials("learner", [Credential("token", config.token)], insecure=config.insecure)
    setup_tracing("rlfabric-learner")
    world = init_distributed()
    if world.is_main:
        serve_metrics("learner", config.server)
    try:
        trainer = Trainer(config.run, config.run.model.path, device=world.device, world=world)
        asyncio.run(TrainingLoop(config, world, trainer).run())
        leave_together()
    finally:
        destroy_distributed()
    log.info("learner exited", extra={"pid": os.getpid()})
    exit_rank(0)
