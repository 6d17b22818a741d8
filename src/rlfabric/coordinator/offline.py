"""An offline preference run as the coordinator drives it: nothing to dispatch.

The learner trains on the run's dataset itself (`rlfabric.learner.offline`) and reports through Redis as
an online learner does (metrics rows, `keys.step`, `keys.version`), so the run page, `runs status` and
`rlfabric up` show it the same way. The coordinator only waits for its end:

    loop until one holds:
      1. a stop was requested          -> stopped
      2. the learner finished its data -> completed (`keys.learner_done`)
      3. the step budget is reached    -> completed
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rlfabric.contracts import keys
from rlfabric.coordinator.runs import RunState
from rlfabric.runspec import RunSpec
from rlfabric.runtime.aio import cancel_point

POLL_S = 0.5
"""How often the learner's progress is looked at."""


async def watch_offline(
    redis: Any, run_id: str, spec: RunSpec, stop: Callable[[], Awaitable[bool]]
) -> RunState:
    """Waits for the offline run's end; returns its final state."""
    while True:
        cancel_point()
        if await stop():
            return RunState.STOPPED
        if await redis.get(keys.learner_done(run_id)) is not None:
            return RunState.COMPLETED
        if int(await redis.get(keys.step(run_id)) or 0) >= spec.train.steps:
            return RunState.COMPLETED
        await asyncio.sleep(POLL_S)
