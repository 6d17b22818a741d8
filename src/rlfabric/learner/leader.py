"""Rank 0's part of the learner: every byte of its I/O outside the collectives.

The other ranks never touch Redis, the object store's announcements, metrics or the status server; they
meet rank 0 only in the collectives of `loop.TrainingLoop`. Rank 0 holds one `Leader`, which:
- reads the step's groups (`StepSource`: stale ones dropped, those of rolled-back versions handed back)
  and acknowledges them once a checkpoint covers them;
- publishes weights (`Publisher`: object store, then the Redis announcement);
- reports each step (metrics.jsonl, TensorBoard, Prometheus, the run's Redis keys, GetStatus, the
  experiment trackers of `tracking.py`);
- plans, records and marks a restart (`restart.py`);
- serves `LearnerService.GetStatus` and turns SIGTERM into a stop request.
It reads the trainer's step and policy version and never writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfabric.contracts import keys, lineage
from rlfabric.contracts.keys import Counter, StopReason
from rlfabric.contracts.lineage import HandBack, Lineage
from rlfabric.contracts.metrics import append_row
from rlfabric.contracts.streams import drop_stale_once
from rlfabric.data import dataset_version
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.dist import World
from rlfabric.learner.outputs import RunPaths, StepExport, write_metrics
from rlfabric.learner.queue import AppliedLedger, Delivery, GroupConsumer
from rlfabric.learner.restart import Restart, mark_restart, plan_restart, record_restart
from rlfabric.learner.tracking import Trackers
from rlfabric.learner.trainer_base import TrainerBase
from rlfabric.runtime import failpoints
from rlfabric.runtime.grpc_server import GrpcServer, check_bearer, full_service_name, options_from_config
from rlfabric.v1 import learner_pb2, learner_pb2_grpc
from rlfabric.weights import adapters
from rlfabric.weights import versions as store

log = logging.getLogger(__name__)
SERVICE = full_service_name(learner_pb2, "LearnerService")
FINAL_EVAL_TIMEOUT_S = 600.0
"""How long the last step's row waits for the coordinator's evaluation of the final policy
(`keys.final_eval`); then it is written without one."""
FINAL_EVAL_POLL_S = 0.25


class Status(learner_pb2_grpc.LearnerServiceServicer):
    """What GetStatus reports; rank 0's loop keeps it current. With a `token`, a call without
    `authorization: Bearer <token>` is answered UNAUTHENTICATED."""

    def __init__(self, run_id: str, world_size: int, token: str | None = None) -> None:
        self.token = token
        self.message = learner_pb2.LearnerStatus(
            run_id=run_id, state=learner_pb2.LEARNER_STATE_STARTING, world_size=world_size
        )

    async def GetStatus(self, request: Any, context: Any) -> learner_pb2.LearnerStatus:
        check_bearer(context, self.token)
        return self.message


@dataclass
class Counters:
    """Every group the learner read ends in exactly one of these (dead letters are the consumer's)."""

    trained: int = 0
    dropped_stale: int = 0
    rolled_back: int = 0
    """Groups of rolled-back versions handed back to the coordinator (they are generated again)."""
    staleness: list[int] = field(default_factory=list)


class StepSource:
    """Rank 0's reader: exactly `groups_per_step` fresh groups per step (stale ones are dropped, recorded
    and acked; those of rolled-back versions handed back), so that a step is the batch the run asked for
    and the coordinator's lag bound, which counts in whole steps, holds. Groups read while a step is not
    full yet wait in `ready`. Staleness is counted in steps of the lineage (`Lineage.lag`), not in version
    numbers: a restore's version holds the checkpoint's weights, so the checkpoint's samples are on-policy
    for it."""

    def __init__(self, consumer: GroupConsumer, redis: Any, run_id: str, max_staleness: int) -> None:
        self.consumer, self.redis, self.run_id, self.max_staleness = consumer, redis, run_id, max_staleness
        self.counters = Counters()
        self.ready: list[Delivery] = []
        self.lineage = Lineage()

    async def collect(self, count: int, version: int, *, timeout_s: float) -> list[Delivery]:
        """`count` trainable deliveries generated at most max_staleness steps before `version`'s, or []
        when that many did not arrive within `timeout_s` (those that did wait for the next call)."""
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < count and time.monotonic() < deadline:
            for delivery in await self.consumer.read(count - len(self.ready), block_ms=500):
                await self.sort(delivery, version)
        if len(self.ready) < count:
            return []
        batch, self.ready = self.ready[:count], self.ready[count:]
        return batch

    async def sort(self, delivery: Delivery, version: int) -> None:
        """Hands back, drops as stale, or keeps for a step one delivery."""
        group = delivery.group
        assert group is not None
        if self.lineage.is_rolled_back(group.policy_version):
            await self.hand_back(delivery)
            return
        lag = self.lineage.lag(version, group.policy_version)
        if lag > self.max_staleness:
            await self.drop_stale(delivery, lag, version)
        else:
            self.counters.staleness.append(lag)
            self.ready.append(delivery)

    async def hand_back(self, delivery: Delivery) -> None:
        """A group of a rolled-back version goes back to the coordinator under a new id (acknowledged,
        recorded and counted in one script)."""
        group = delivery.group
        assert group is not None
        handed = HandBack(
            delivery.entry_id, group.group_id, group.prompt_id, group.epoch, group.policy_version
        )
        new_id = await lineage.hand_back(self.redis, self.run_id, handed)
        self.consumer.forget(delivery.entry_id)
        self.counters.rolled_back += 1
        log.info("group %s of rolled-back version %d handed back as %s", group.group_id, group.policy_version,
                 new_id)  # fmt: skip

    def take_rest(self) -> list[Delivery]:
        """The groups read for a step that will never fill (the run ended): the last, smaller step."""
        rest, self.ready = self.ready, []
        return rest

    async def drop_stale(self, delivery: Delivery, lag: int, version: int) -> None:
        assert delivery.group is not None
        group_id = delivery.group.group_id
        await drop_stale_once(self.redis, self.run_id, delivery.entry_id, group_id, lag, version)
        await self.consumer.ack([delivery.entry_id])  # acknowledged already: this clears the local record
        self.counters.dropped_stale += 1
        log.info("dropped stale group %s (lag %d)", group_id, lag)


class Publisher:
    """Rank 0's weight publishing: object store, then the Redis announcement replicas can watch."""

    def __init__(self, paths: RunPaths, redis: Any, run_id: str, keep: int) -> None:
        self.paths, self.redis, self.run_id, self.keep = paths, redis, run_id, keep

    def latest_published(self) -> int:
        """The newest version published (committed in the store; 0 when none)."""
        return store.latest_committed(self.paths.weights_root) or 0

    async def publish(
        self, version: int, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any] | None = None
    ) -> float:
        start = time.perf_counter()
        store.publish_version(self.paths.weights_root, version, state_dict, metadata=metadata)
        return await self._announce(version, start)

    async def publish_adapter(
        self,
        version: int,
        adapter: dict[str, torch.Tensor],
        peft_config: dict[str, Any],
        metadata: dict[str, Any] | None = None,
    ) -> float:
        """Publishes a LoRA adapter alone as `version` (`rlfabric.weights.adapters`), then announces it."""
        start = time.perf_counter()
        adapters.publish_adapter(self.paths.weights_root, version, adapter, peft_config, metadata=metadata)
        return await self._announce(version, start)

    async def _announce(self, version: int, start: float) -> float:
        """Prunes old versions and announces `version` in Redis; returns the seconds since `start`."""
        store.prune(self.paths.weights_root, keep=self.keep)
        await self.redis.set(keys.version(self.run_id), version)
        await self.redis.publish(keys.versions(self.run_id), version)
        return time.perf_counter() - start


class Leader:
    """Rank 0's Redis I/O, publishing, reporting and status server (the module docstring's list).

    Built after `restore` (its consumer skips the restored ledger's groups), started before the loop."""

    def __init__(
        self,
        config: LearnerServiceConfig,
        world: World,
        paths: RunPaths,
        trainer: TrainerBase[Any],
        ledger: AppliedLedger,
    ) -> None:
        self.config, self.spec, self.world, self.paths, self.trainer = (
            config,
            config.run,
            world,
            paths,
            trainer,
        )
        self.run_id = config.run_id
        self.status = Status(config.run_id, world.size, config.token)
        self.stopping = False
        self.health_stop = False
        self.redis = config.redis.connect()
        self.source = StepSource(
            self._consumer(ledger), self.redis, config.run_id, self.spec.rollout.max_staleness
        )
        self.publisher = Publisher(paths, self.redis, config.run_id, self.spec.weights.keep_versions)
        self.export = StepExport(paths.run_dir, config.run_id)
        self.trackers = Trackers.start(
            self.spec, config.run_id, paths.run_dir, dataset_version(self.spec.dataset.path)
        )

    def _consumer(self, ledger: AppliedLedger) -> GroupConsumer:
        name = self.config.consumer_name or f"learner-{socket.gethostname()}"
        return GroupConsumer(
            self.redis,
            self.run_id,
            name,
            max_deliveries=self.config.max_deliveries,
            claim_idle_ms=self.config.claim_idle_ms,
            ledger=ledger,
            expected_n=self.spec.rollout.sampling.n,
        )

    async def start(self) -> None:
        """Serve GetStatus, and stop on SIGTERM."""
        self.server = GrpcServer(options_from_config(self.config.server))
        self.server.add_servicer(learner_pb2_grpc.add_LearnerServiceServicer_to_server, self.status, SERVICE)
        port = await self.server.start()
        host = self.config.server.host
        print(f"rlfabric learner (rank 0 of {self.world.size}) listening on {host}:{port}", flush=True)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.request_stop)

    def request_stop(self) -> None:
        self.stopping = True

    def set_state(self, state: int) -> None:
        self.status.message.state = state  # type: ignore[assignment]

    # -- restart ------------------------------------------------------------------------------------

    async def plan_restart(self) -> Restart | None:
        return await plan_restart(self.redis, self.run_id, self.publisher, self.trainer)

    async def record_restart(self, restart: Restart) -> None:
        await record_restart(self.redis, self.run_id, restart)

    async def resumed(self, restart: Restart, trained: int) -> None:
        """Once the trainer holds the restart's version: read in the restored lineage, mark the restart."""
        self.source.lineage = restart.lineage
        await mark_restart(self.redis, self.run_id, self.paths, restart, trained)
        self.status.message.step, self.status.message.policy_version = (
            restart.step,
            self.trainer.policy_version,
        )

    # -- reading and acknowledging ------------------------------------------------------------------

    async def collect(self) -> list[Delivery] | None:
        """The step's deliveries ([] if none arrived in time; None to stop)."""
        if self.stopping or await self.stop_reason() == StopReason.HEALTH:
            return None
        self.set_state(learner_pb2.LEARNER_STATE_WAITING)
        groups, version = self.spec.train.groups_per_step, self.trainer.policy_version
        deliveries = await self.source.collect(groups, version, timeout_s=5.0)
        if not deliveries:
            reason = await self.stop_reason()
            if reason is None:
                return []  # the step is not full yet: wait on
            # the run was stopped or its prompts ran out: train what was read, then stop
            deliveries = [] if reason == StopReason.HEALTH else self.source.take_rest()
            if not deliveries:
                return None
        failpoints.hit("learner.after_read")
        return deliveries

    async def stop_reason(self) -> str | None:
        """Why the coordinator ended the run, None while it goes on. "health" (a health check stopped
        it) means: stop before another step and, in `finish`, write no checkpoint of the suspect policy,
        so the good ones stay."""
        raw = await self.redis.get(keys.stop_requested(self.config.run_id))
        reason = raw.decode() if isinstance(raw, bytes) else raw
        self.health_stop = reason == StopReason.HEALTH
        return reason

    async def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge entries a complete checkpoint covers."""
        await self.source.consumer.ack(entry_ids)

    def checkpointed(self) -> None:
        """A checkpoint of the trainer's current step is complete."""
        self.status.message.checkpoint_step = self.trainer.step

    # -- reporting ----------------------------------------------------------------------------------

    async def report(self, metrics: dict[str, float], groups: int, applied: int) -> None:
        """One row per step: metrics.jsonl, the run's Redis metrics stream, GetStatus and the trackers
        (with the curves after a checkpoint); the last step's row after the final policy's held-out
        evaluation (`final_evaluation`). `applied` counts the groups applied in this lineage (a crash
        rolls it back with the checkpoint it restores)."""
        counters = self.source.counters
        counters.trained += groups
        if self.trainer.step >= self.spec.train.steps and self.spec.dataset.evaluated:
            await self.final_evaluation()
        row = self.build_row(metrics, counters)
        row.update(await self.take_eval_results())
        row.update(await self.rollout_utilisation())
        write_metrics(self.paths.metrics, row)
        self.export.write(row)
        self.trackers.step(row)
        if "checkpoint_step" in metrics:
            self.trackers.curves(self.trainer.step)
        await append_row(self.redis, self.config.run_id, row)
        await self.redis.set(keys.step(self.config.run_id), self.trainer.step)
        await self.redis.hset(keys.counters(self.config.run_id), Counter.GROUPS_TRAINED, applied)
        self.update_status(metrics, counters)

    def build_row(self, metrics: dict[str, float], counters: Counters) -> dict[str, Any]:
        step_staleness = list(counters.staleness) or [0]  # the lags of this step's groups
        counters.staleness.clear()
        seconds = metrics.get("step_seconds", 0.0)
        row: dict[str, Any] = {
            "step": self.trainer.step,
            "policy_version": self.trainer.policy_version,
            "time": time.time(),
        }
        row.update(metrics)
        row["tokens_per_s"] = metrics.get("tokens", 0.0) / seconds if seconds else 0.0
        row["staleness_mean"] = sum(step_staleness) / len(step_staleness)
        row.update(groups_trained=counters.trained, groups_dropped_stale=counters.dropped_stale)
        row["groups_rolled_back"] = counters.rolled_back
        row.update({f"queue_{k}": v for k, v in self.source.consumer.counters.as_dict().items()})
        return row

    async def final_evaluation(self) -> None:
        """Asks the coordinator to evaluate the final policy, already published (`keys.final_eval`), and
        waits until it has (it deletes the request), so the run's last row carries the held-out reward
        of the policy the run ends with; gives up after `FINAL_EVAL_TIMEOUT_S` or on a stop request."""
        key = keys.final_eval(self.config.run_id)
        await self.redis.set(key, self.trainer.step)
        start = time.monotonic()
        while await self.redis.exists(key):
            if await self.stop_reason() is not None:
                break
            if time.monotonic() - start > FINAL_EVAL_TIMEOUT_S:
                log.warning(
                    "the final policy's evaluation did not finish within %.0f s; the last row has none",
                    FINAL_EVAL_TIMEOUT_S,
                )
                break
            await asyncio.sleep(FINAL_EVAL_POLL_S)
        await self.redis.delete(key)

    async def take_eval_results(self) -> dict[str, float]:
        """Held-out results the coordinator pushed since the last row (the latest one wins)."""
        key = keys.eval_results(self.config.run_id)
        raw: list[bytes] | None = await self.redis.lpop(key, 1000)  # type: ignore[assignment]
        if not raw:
            return {}
        latest = json.loads(raw[-1])
        row = {"eval_reward_mean": latest["reward_mean"], "eval_policy_version": latest["policy_version"]}
        if "step" in latest:
            row["eval_step"] = latest["step"]
        if "gold_reward_mean" in latest:  # a run with a gold reward (`dataset.eval.reward`)
            row["eval_gold_reward_mean"] = latest["gold_reward_mean"]
        return row

    async def rollout_utilisation(self) -> dict[str, float]:
        """The coordinator's latest busy fractions of the run's replicas (its autoscaling signal): over
        its recent window, and since the run's first dispatch."""
        key = keys.scaling(self.config.run_id)
        recent, run = await self.redis.hmget(key, ["busy_fraction", "run_busy_fraction"])  # type: ignore[misc]
        if recent is None or run is None:
            return {}
        return {"rollout_busy_fraction": float(recent), "rollout_busy_fraction_run": float(run)}

    def update_status(self, metrics: dict[str, float], counters: Counters) -> None:
        queue = self.source.consumer.counters
        msg = self.status.message
        msg.step, msg.policy_version = self.trainer.step, self.trainer.policy_version
        msg.groups_trained, msg.groups_dropped_stale = counters.trained, counters.dropped_stale
        msg.groups_skipped_duplicate = queue.skipped_duplicate
        msg.groups_dead_lettered = queue.dead_lettered_total
        msg.last_metrics.clear()
        msg.last_metrics.update({k: float(v) for k, v in metrics.items()})

    async def close(self) -> None:
        """The run is over: DONE in GetStatus, exports closed, the status server and Redis let go."""
        self.set_state(learner_pb2.LEARNER_STATE_DONE)
        self.export.close()
        self.trackers.close(self.trainer.step)
        step, version = self.trainer.step, self.trainer.policy_version
        print(f"rlfabric learner done at step {step}, version {version}", flush=True)
        await self.server.stop(1.0)
        with contextlib.suppress(Exception):
            await self.redis.aclose()
