"""`rlfabric serve learner`: one learner rank (run it under torchrun for several).

Every rank runs the same loop (`loop.py` describes its steps); rank 0 alone talks to Redis, writes the
object store, and serves `LearnerService.GetStatus`. Training runs on a worker thread so that rank 0's
event loop keeps answering status calls during a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from typing import Any

from rlfabric.contracts import keys
from rlfabric.contracts.keys import Counter, StopReason
from rlfabric.contracts.metrics import append_row
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.dist import World, destroy_distributed, init_distributed
from rlfabric.learner.loop import (
    Publisher,
    RunPaths,
    StepExport,
    StepSource,
    broadcast_flag,
    checkpoint,
    mark_restart,
    plan_restart,
    record_restart,
    restore,
    share_payloads,
    to_group_samples,
    write_metrics,
)
from rlfabric.learner.queue import AppliedLedger, Delivery, GroupConsumer
from rlfabric.learner.trainer import Trainer
from rlfabric.runtime import failpoints, telemetry
from rlfabric.runtime.credentials import Credential, require_credentials
from rlfabric.runtime.grpc_server import GrpcServer, check_bearer, full_service_name, options_from_config
from rlfabric.runtime.logs import setup_logging
from rlfabric.runtime.metrics import start_metrics_server
from rlfabric.runtime.telemetry import setup_tracing
from rlfabric.v1 import learner_pb2, learner_pb2_grpc, queue_pb2

log = logging.getLogger(__name__)
SERVICE = full_service_name(learner_pb2, "LearnerService")


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


class Learner:
    def __init__(self, config: LearnerServiceConfig, world: World, trainer: Trainer) -> None:
        self.config, self.world, self.trainer = config, world, trainer
        self.spec = config.run
        self.paths = RunPaths.of(config)
        self.status = Status(config.run_id, world.size, config.token)
        self.stopping = False
        self.health_stop = False
        self.pending: list[str] = []  # entry ids trained but not yet covered by a checkpoint
        self.ledger = AppliedLedger()
        self.applied_log: list[list[Any]] = []  # [step, group_id] in the order applied, in this lineage
        self.version = 0

    # --- set-up (rank 0 owns Redis and the status server) ------------------------------------------

    async def start(self) -> None:
        self.ledger, self.applied_log = restore(self.trainer, self.paths)
        if not self.world.is_main:
            return
        self.redis = self.config.redis.connect()
        name = self.config.consumer_name or f"learner-{socket.gethostname()}"
        consumer = GroupConsumer(
            self.redis,
            self.config.run_id,
            name,
            max_deliveries=self.config.max_deliveries,
            claim_idle_ms=self.config.claim_idle_ms,
            ledger=self.ledger,
            expected_n=self.spec.rollout.sampling.n,
        )
        self.source = StepSource(consumer, self.redis, self.config.run_id, self.spec.rollout.max_staleness)
        self.publisher = Publisher(
            self.paths, self.redis, self.config.run_id, self.spec.weights.keep_versions
        )
        self.version = self.trainer.policy_version
        self.export = StepExport(self.paths.run_dir)
        await self.start_status_server()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.request_stop)

    async def start_status_server(self) -> None:
        self.server = GrpcServer(options_from_config(self.config.server))
        self.server.add_servicer(learner_pb2_grpc.add_LearnerServiceServicer_to_server, self.status, SERVICE)
        port = await self.server.start()
        print(
            f"rlfabric learner (rank 0 of {self.world.size}) listening on {self.config.server.host}:{port}",
            flush=True,
        )

    def request_stop(self) -> None:
        self.stopping = True

    async def resume(self) -> None:
        """Collective, after `start`. A restarted learner publishes the restored weights at once when the
        newest published version does not hold them, so the replicas move to the restored policy; hands
        back, as it reads them, the groups of the versions that rolled back; marks the restart in the
        metrics (`loop.plan_restart`, `rlfabric.contracts.lineage`)."""
        restart = None
        if self.world.is_main:
            restart = await plan_restart(self.redis, self.config.run_id, self.publisher, self.trainer)
        publish = restart.plan.publish if restart is not None else None
        if broadcast_flag(publish is not None, self.world):
            if restart is not None:  # rank 0
                await record_restart(self.redis, self.config.run_id, restart)
            await self.publish_weights(publish or 0, restart.metadata if restart is not None else None)
        if restart is None:
            return
        self.version = self.trainer.policy_version = restart.plan.version
        self.source.lineage = restart.lineage
        await mark_restart(self.redis, self.config.run_id, self.paths, restart, len(self.ledger))
        self.status.message.step, self.status.message.policy_version = restart.step, self.version

    # --- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        await self.start()
        await self.resume()
        while self.trainer.step < self.spec.train.steps:
            deliveries = await self.collect()
            payloads = share_payloads(self.encode(deliveries), self.world)
            if payloads is None:
                break
            if payloads:
                await self.step(deliveries, payloads)
        await self.finish()

    async def collect(self) -> list[Delivery] | None:
        """Rank 0: the step's deliveries ([] if none arrived in time; None to stop)."""
        if not self.world.is_main:
            return []
        if self.stopping or await self.stop_reason() == StopReason.HEALTH:
            return None
        self.set_state(learner_pb2.LEARNER_STATE_WAITING)
        deliveries = await self.source.collect(self.spec.train.groups_per_step, self.version, timeout_s=5.0)
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

    def encode(self, deliveries: list[Delivery] | None) -> list[bytes] | None:
        if deliveries is None:
            return None
        return [d.group.SerializeToString() for d in deliveries if d.group is not None]

    async def step(self, deliveries: list[Delivery] | None, payloads: list[bytes]) -> None:
        messages = [queue_pb2.ScoredGroup.FromString(p) for p in payloads]
        traced = [(c, m) for m in messages if (c := telemetry.from_trace_context(m.trace)) is not None]
        attributes: dict[str, str | int] = {
            "run_id": self.config.run_id,
            "step": self.trainer.step + 1,
            "groups": len(messages),
        }
        with telemetry.span("learner.step", attributes=attributes, links=[c for c, _ in traced]):
            await self.train_publish_report(deliveries, [to_group_samples(m) for m in messages])
        for parent, message in traced:  # each group's own trace ends with the step that consumed it
            span_attributes: dict[str, str | int] = {"step": self.trainer.step, "group_id": message.group_id}
            with telemetry.span("learner.trained", parent=parent, attributes=span_attributes):
                pass

    async def train_publish_report(self, deliveries: list[Delivery] | None, groups: list[Any]) -> None:
        self.set_state(learner_pb2.LEARNER_STATE_TRAINING)
        start = time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.train_step, groups)
        metrics["step_seconds"] = time.perf_counter() - start
        self.ledger.update(g.group_id for g in groups)
        self.applied_log.extend([self.trainer.step, g.group_id] for g in groups)
        self.pending.extend(d.entry_id for d in deliveries or [])
        failpoints.hit("learner.after_step")
        self.version += 1
        self.trainer.policy_version = self.version
        self.set_state(learner_pb2.LEARNER_STATE_PUBLISHING)
        await self.persist_if_due(metrics)
        await self.publish(metrics)
        await self.report(metrics, len(groups))

    async def persist_if_due(self, metrics: dict[str, float]) -> None:
        due = (
            self.trainer.step % self.spec.train.checkpoint_every == 0
            or self.trainer.step >= self.spec.train.steps
        )
        if not due:
            return
        start = time.perf_counter()
        await asyncio.to_thread(self.checkpoint)
        if self.world.is_main and self.pending:
            failpoints.hit("learner.before_ack")
            await self.source.consumer.ack(self.pending)
            self.pending = []
        metrics["checkpoint_seconds"] = time.perf_counter() - start
        metrics["checkpoint_step"] = self.trainer.step
        self.status.message.checkpoint_step = self.trainer.step

    async def publish(self, metrics: dict[str, float]) -> None:
        seconds = await self.publish_weights(self.version, {"step": self.trainer.step})
        if self.world.is_main:
            metrics["publish_seconds"] = seconds

    async def publish_weights(self, version: int, metadata: dict[str, Any] | None = None) -> float:
        """Collective: gathers the full weights; rank 0 publishes them as `version` (returns its seconds)."""
        state_dict = await asyncio.to_thread(self.trainer.full_state_dict)
        if getattr(self.trainer.model.config, "tie_word_embeddings", False):
            state_dict.pop("lm_head.weight", None)  # tied to the embeddings: checkpoints leave it out
        if not self.world.is_main:
            return 0.0
        return await self.publisher.publish(version, state_dict, metadata)

    async def report(self, metrics: dict[str, float], groups: int) -> None:
        """One row per step: metrics.jsonl, the run's Redis metrics stream, and GetStatus."""
        if not self.world.is_main:
            return
        counters = self.source.counters
        counters.trained += groups
        row = self.build_row(metrics, counters)
        row.update(await self.take_eval_results())
        row.update(await self.rollout_utilisation())
        write_metrics(self.paths.metrics, row)
        self.export.write(row)
        await append_row(self.redis, self.config.run_id, row)
        await self.redis.set(keys.step(self.config.run_id), self.trainer.step)
        # the groups applied in this lineage (a crash rolls it back with the checkpoint it restores)
        await self.redis.hset(keys.counters(self.config.run_id), Counter.GROUPS_TRAINED, len(self.ledger))
        self.update_status(metrics, counters)

    def build_row(self, metrics: dict[str, float], counters: Any) -> dict[str, Any]:
        step_staleness = list(counters.staleness) or [0]  # the lags of this step's groups
        counters.staleness.clear()
        seconds = metrics.get("step_seconds", 0.0)
        row: dict[str, Any] = {"step": self.trainer.step, "policy_version": self.version, "time": time.time()}
        row.update(metrics)
        row["tokens_per_s"] = metrics.get("tokens", 0.0) / seconds if seconds else 0.0
        row["staleness_mean"] = sum(step_staleness) / len(step_staleness)
        row.update(groups_trained=counters.trained, groups_dropped_stale=counters.dropped_stale)
        row["groups_rolled_back"] = counters.rolled_back
        row.update({f"queue_{k}": v for k, v in self.source.consumer.counters.as_dict().items()})
        return row

    async def take_eval_results(self) -> dict[str, float]:
        """Held-out results the coordinator pushed since the last row (the latest one wins)."""
        key = keys.eval_results(self.config.run_id)
        raw: list[bytes] | None = await self.redis.lpop(key, 1000)  # type: ignore[assignment]
        if not raw:
            return {}
        latest = json.loads(raw[-1])
        return {"eval_reward_mean": latest["reward_mean"], "eval_policy_version": latest["policy_version"]}

    async def rollout_utilisation(self) -> dict[str, float]:
        """The coordinator's latest busy fractions of the run's replicas (its autoscaling signal): over
        its recent window, and since the run's first dispatch."""
        key = keys.scaling(self.config.run_id)
        recent, run = await self.redis.hmget(key, ["busy_fraction", "run_busy_fraction"])  # type: ignore[misc]
        if recent is None or run is None:
            return {}
        return {"rollout_busy_fraction": float(recent), "rollout_busy_fraction_run": float(run)}

    def update_status(self, metrics: dict[str, float], counters: Any) -> None:
        queue = self.source.consumer.counters
        msg = self.status.message
        msg.step, msg.policy_version = self.trainer.step, self.version
        msg.groups_trained, msg.groups_dropped_stale = counters.trained, counters.dropped_stale
        msg.groups_skipped_duplicate = queue.skipped_duplicate
        msg.groups_dead_lettered = queue.dead_lettered_total
        msg.last_metrics.clear()
        msg.last_metrics.update({k: float(v) for k, v in metrics.items()})

    def set_state(self, state: int) -> None:
        self.status.message.state = state  # type: ignore[assignment]

    def checkpoint(self) -> None:
        """Collective: a checkpoint with the ledger, keeping `train.keep_checkpoints` complete ones."""
        keep = self.spec.train.keep_checkpoints
        checkpoint(self.trainer, self.paths, self.ledger, self.applied_log, keep=keep)

    async def finish(self) -> None:
        self.health_stop = broadcast_flag(self.health_stop, self.world)  # rank 0 alone read it
        if self.health_stop:
            log.warning("stopped by a health check at step %d: no final checkpoint", self.trainer.step)
        elif self.trainer.step > 0 and self.status.message.checkpoint_step != self.trainer.step:
            await asyncio.to_thread(self.checkpoint)
            if self.world.is_main and self.pending:
                await self.source.consumer.ack(self.pending)
        self.set_state(learner_pb2.LEARNER_STATE_DONE)
        if self.world.is_main:
            self.export.close()
            print(f"rlfabric learner done at step {self.trainer.step}, version {self.version}", flush=True)
            await self.server.stop(1.0)
            with contextlib.suppress(Exception):
                await self.redis.aclose()


def serve(config: LearnerServiceConfig) -> int:
    if config.run.mode == "offline_preference":
        from rlfabric.learner.offline import serve_offline

        return serve_offline(config)
    setup_logging("learner", config.log.level, config.log.format)
    require_credentials("learner", [Credential("token", config.token)], insecure=config.insecure)
    setup_tracing("rlfabric-learner")
    world = init_distributed()
    if world.is_main and config.server.metrics_port is not None:
        port = start_metrics_server(config.server.host, config.server.metrics_port)
        print(f"rlfabric learner metrics on http://{config.server.host}:{port}/metrics", flush=True)
    try:
        trainer = Trainer(config.run, config.run.model.path, device=world.device, world=world)
        asyncio.run(Learner(config, world, trainer).run())
    finally:
        destroy_distributed()
    log.info("learner exited", extra={"pid": os.getpid()})
    return 0
