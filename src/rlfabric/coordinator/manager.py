"""Runs the pipelines of the coordinator's runs, and resumes them after a restart.

A submitted run becomes `running` and gets a `RunPipeline` task. The pipeline's end decides the state:
`completed` when the learner reached its step budget (or every prompt was trained), `stopped` after a stop
request, `failed` with the reason when the dataset cannot be used or the pipeline crashes. In every final
state the learner is told to finish (`keys.stop_requested`), so `rlfabric up` can shut down.
An offline preference run has no pipeline: the coordinator waits for its learner (`offline.py`).
A progress task mirrors the learner's latest step and version into the run record; for a run with
`health.auto_stop` checks, a health task stops the run when one triggers (keeping the last good checkpoint);
a liveness task logs each warning of a run that waits (no replica, no learner, no reward service, a model
that does not load) when it appears, within `checks.interval_s`.
A run on a shared rollout fleet (`rollout.fleet`) joins the fleet's members (`contracts.fleet`) before its
pipeline starts, and leaves in every ending (completed, stopped, failed, or the coordinator shutting down),
so the fleet's replicas free its adapter slot; its pipeline generates through the coordinator's one
`FleetScheduler` of that fleet, shared with the fleet's other runs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rlfabric.contracts import fleet, keys
from rlfabric.contracts.keys import StopReason
from rlfabric.coordinator.checks import model_warning, reward_warning
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.fleet import FleetScheduler
from rlfabric.coordinator.health import HEALTH_ROWS, last_good_checkpoint, length_limit, stopping_warning
from rlfabric.coordinator.liveness import liveness_warnings
from rlfabric.coordinator.offline import watch_offline
from rlfabric.coordinator.pipeline import RunPipeline
from rlfabric.coordinator.runs import InvalidTransition, RunRecord, RunState, RunStore
from rlfabric.data import DatasetError
from rlfabric.runtime.aio import cancel_point
from rlfabric.weights.adapters import run_adapter_name

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
"""How often a run with automatic stops has its health checked."""


class RunManager:
    def __init__(self, config: CoordinatorServiceConfig, redis: Any) -> None:
        self.config, self.redis = config, redis
        self.store = RunStore(redis)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.logged: dict[str, set[str]] = {}
        """Each run's liveness warnings at the last look (a warning is logged when it appears)."""
        self.fleets: dict[str, FleetScheduler] = {}
        """The scheduler of each shared fleet a run of this coordinator used, by fleet name."""

    async def resume(self) -> None:
        """Picks up the runs a previous coordinator left pending or running."""
        for record in await self.store.list(states={RunState.PENDING, RunState.RUNNING}, limit=1000):
            await self.on_submit(record)

    async def on_submit(self, record: RunRecord) -> None:
        if record.run_id in self.tasks:
            return
        await self.store.set_state(record.run_id, RunState.RUNNING)
        task = asyncio.get_running_loop().create_task(self.drive(record))
        self.tasks[record.run_id] = task

    async def on_stop(self, record: RunRecord) -> None:
        """The API already flagged the run; the pipeline notices at its next loop."""

    async def drive(self, record: RunRecord) -> None:
        run_id = record.run_id
        loop = asyncio.get_running_loop()
        helpers = [
            loop.create_task(self.mirror_progress(run_id)),
            loop.create_task(self.watch_health(record)),
            loop.create_task(self.watch_liveness(record)),
        ]
        try:
            state, error = await self.run_pipeline(record), None
        except DatasetError as exc:
            state, error = RunState.FAILED, str(exc)
        except Exception as exc:
            log.exception("run %s failed", run_id)
            state, error = RunState.FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            for helper in helpers:
                helper.cancel()
            self.tasks.pop(run_id, None)
            self.logged.pop(run_id, None)
            await self.leave_fleet(record)
        # nx: a health stop already told the learner "health" (stop at once, no further checkpoint)
        await self.redis.set(keys.stop_requested(run_id), StopReason(state).value, nx=True)
        await self.sync_progress(run_id)
        try:
            await self.store.set_state(run_id, state, error)
        except InvalidTransition:  # already final (a pending run stopped by the API): keep that state
            log.info("run %s was already final; pipeline ended as %s", run_id, state)
        log.info("run %s %s", run_id, state)

    async def run_pipeline(self, record: RunRecord) -> RunState:
        """The online pipeline, or for an offline run the wait for its learner (nothing to dispatch)."""
        stop = lambda: self.store.stop_requested(record.run_id)  # noqa: E731
        if record.spec.mode != "online":
            return await watch_offline(self.redis, record.run_id, record.spec, stop)
        await self.join_fleet(record)
        pipeline = RunPipeline(
            record.run_id,
            record.spec,
            self.redis,
            self.config.reward_address,
            self.config.max_stream_length,
            self.config.scaling,
            reward_token=self.config.reward_token,
            rollout_token=self.config.rollout_token,
            fleet=self.fleet_scheduler(record.spec.rollout.fleet),
        )
        return await pipeline.run(stop)

    def fleet_scheduler(self, name: str | None) -> FleetScheduler | None:
        """The coordinator's scheduler of fleet `name` (created at its first use); None without a fleet."""
        if name is None:
            return None
        if name not in self.fleets:
            scheduler = FleetScheduler(self.redis, name, self.config.scaling, token=self.config.rollout_token)
            self.fleets[name] = scheduler
        return self.fleets[name]

    async def join_fleet(self, record: RunRecord) -> None:
        """Makes a run on a shared fleet one of its members (its replicas then load the run's adapter from
        the run's weights root)."""
        spec = record.spec
        if spec.rollout.fleet is None:
            return
        weights_root = spec.weights_root(record.run_id)  # where the run's learner publishes
        member = fleet.FleetMember(
            record.run_id, run_adapter_name(record.run_id), weights_root, spec.rollout.fleet_weight
        )
        await fleet.join(self.redis, spec.rollout.fleet, member)
        log.info("run %s joined fleet %s", record.run_id, spec.rollout.fleet)

    async def leave_fleet(self, record: RunRecord) -> None:
        """Takes an ended run off its fleet's members (a no-op for a run on its own replicas)."""
        name = record.spec.rollout.fleet
        if name is None:
            return
        try:
            await fleet.leave(self.redis, name, record.run_id)
            log.info("run %s left fleet %s", record.run_id, name)
        except Exception:  # Redis unreachable: the member stays listed until a later coordinator's cleanup
            log.warning("run %s could not leave fleet %s", record.run_id, name, exc_info=True)

    async def mirror_progress(self, run_id: str) -> None:
        while True:
            cancel_point()
            await asyncio.sleep(1.0)
            try:
                await self.sync_progress(run_id)
            except Exception:  # tolerated: the next second tries again
                log.warning("could not mirror progress of %s", run_id, exc_info=True)

    async def sync_progress(self, run_id: str) -> None:
        rows = [
            r for r in await self.store.recent_metrics(run_id, 20) if "step" in r and "policy_version" in r
        ]
        if rows:
            await self.store.update_progress(run_id, int(rows[-1]["step"]), int(rows[-1]["policy_version"]))

    async def watch_health(self, record: RunRecord) -> None:
        """Stops the run when a check in its `health.auto_stop` triggers."""
        if not record.spec.health.auto_stop:
            return
        while True:
            cancel_point()
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                if await self.stop_if_unhealthy(record):
                    return
            except Exception:  # tolerated: Redis restarting; the next interval looks again
                log.warning("health check of %s failed", record.run_id, exc_info=True)

    async def stop_if_unhealthy(self, record: RunRecord) -> bool:
        """One look at the run's metrics; True when it stopped the run. The learner is told first (it
        stops before its next step and writes no further checkpoint, so the good ones stay)."""
        spec, run_id = record.spec, record.run_id
        rows = await self.store.recent_metrics(run_id, HEALTH_ROWS)
        warning = stopping_warning(rows, spec.health, limit=length_limit(spec))
        if warning is None:
            return False
        await self.redis.set(keys.stop_requested(run_id), StopReason.HEALTH.value)
        good = last_good_checkpoint(rows, warning.since_step, spec.train.keep_checkpoints)
        await self.store.add_warning(run_id, warning.message)
        await self.store.request_stop(run_id, f"health: {warning.message}", good)
        log.warning("run %s stopped by its health check %s; last good checkpoint: step %s",
                    run_id, warning.check, good)  # fmt: skip
        return True

    async def watch_liveness(self, record: RunRecord) -> None:
        """Every `checks.interval_s`: the run's liveness warnings (`liveness.py`, and the probes of
        `checks.py`: the reward service answers, the model loads, the latter looked at once), each logged
        when it appears; the probes' warnings are kept in the run record while they hold."""
        model = await model_warning(record.spec)
        shown: set[str] = set()
        while True:
            cancel_point()
            try:
                probes = {w for w in (await reward_warning(self.config, record.spec), model) if w}
                await self.show_probes(record.run_id, shown, probes)
                shown = probes
                await self.log_new_warnings(record.run_id, probes)
            except Exception:  # tolerated: Redis restarting; the next interval looks again
                log.warning("liveness check of %s failed", record.run_id, exc_info=True)
            await asyncio.sleep(self.config.checks.interval_s)

    async def show_probes(self, run_id: str, shown: set[str], probes: set[str]) -> None:
        """Keeps the probes' warnings in the run record: `shown` before, `probes` now."""
        for gone in shown - probes:
            await self.store.remove_warning(run_id, gone)
        for new in probes - shown:
            await self.store.add_warning(run_id, new)

    async def log_new_warnings(self, run_id: str, probes: set[str]) -> None:
        """Logs each liveness warning that was not showing at the previous look."""
        record, stall_s = await self.store.get(run_id), self.config.checks.learner_stall_s
        now = set(await liveness_warnings(self.store, record, stall_s)) | probes
        for warning in sorted(now - self.logged.get(run_id, set())):
            log.warning("run %s: %s", run_id, warning)
        self.logged[run_id] = now

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
