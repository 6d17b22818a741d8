"""The learner service's training loop, run by every rank; rank 0's `Leader` does its I/O.

    resume   restore the newest complete checkpoint (model, optimizer, RNG, step, applied-group ledger);
             after a restart, publish the restored weights at once under a new version when the newest
             published one does not hold them (the versions past the checkpoint are rolled back,
             `rlfabric.contracts.lineage`, `restart.py`), and write a restart marker row in the metrics
    repeat until the run's step budget is spent:
      1. collect   rank 0 reads groups_per_step fresh groups (stale ones are dropped, recorded, acked;
                   those of rolled-back versions are handed back to the coordinator to generate again)
      2. share     rank 0 sends the groups' protobuf bytes to every rank (a byte tensor, never pickle)
      3. train     Trainer.train_step on every rank (FSDP2); the reward components' means join the metrics
      4. persist   every checkpoint_every steps: checkpoint with the ledger, then ack the entries it covers
      5. publish   gather the full weights, write version v to the object store, announce it
      6. report    metrics.jsonl, Prometheus, LearnerService.GetStatus
    finish   a final checkpoint, then the final model as a Hugging Face folder, `<run dir>/model`
             (`export.export_final_model`: LoRA adapters merged), which transformers, vLLM and a later
             run's `model.path` load as is; none after a health stop, whose last good checkpoint is the
             policy to keep

Every rank runs `TrainingLoop`; only rank 0 holds a `Leader` (`leader.py`: Redis, the object store's
announcements, metrics, the status server), the others hold None and meet it in the collectives (2, 3,
4's checkpoint, 5's gather). Training runs on a worker thread so that rank 0's event loop keeps answering
status calls during a step.

Exactly-once: an entry is acknowledged only after a checkpoint that contains its group id in the ledger
is complete. A crash before that leaves it pending (redelivered, trained again on the restored model); a
crash after it leaves it in the restored ledger (skipped on redelivery).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch
from opentelemetry import context as otel_context

from rlfabric.contracts import wire
from rlfabric.learner.batch import GroupSamples
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.core_lock import core_turn
from rlfabric.learner.dist import World, broadcast_flag, share_payloads
from rlfabric.learner.export import drop_tied_head, export_final_model
from rlfabric.learner.leader import Leader
from rlfabric.learner.lora import adapter_config
from rlfabric.learner.outputs import RunPaths
from rlfabric.learner.queue import AppliedLedger, Delivery
from rlfabric.learner.restart import checkpoint, restore
from rlfabric.learner.samples import component_means, trajectory_means
from rlfabric.learner.trainer_base import TrainerBase
from rlfabric.runtime import failpoints, telemetry
from rlfabric.runtime.memory import peak_rss_bytes
from rlfabric.runtime.watchdog import Watchdog
from rlfabric.v1 import learner_pb2, queue_pb2

log = logging.getLogger(__name__)


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: allocated CUDA memory on a GPU (what the planner predicts there),
    else the process's peak RSS (`runtime.memory.peak_rss_bytes`: its own, never its parent's)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


class TrainingLoop:
    """One rank's learner loop (the module docstring's steps). The trainer owns step and policy version;
    the loop only renumbers it once, on a restart (rank 0)."""

    def __init__(
        self, config: LearnerServiceConfig, world: World, trainer: TrainerBase[GroupSamples]
    ) -> None:
        self.config, self.spec, self.world, self.trainer = config, config.run, world, trainer
        self.paths = RunPaths.of(config)
        self.leader: Leader | None = None  # rank 0's I/O, built in `start`; None on the other ranks
        self.ledger = AppliedLedger()
        self.applied_log: list[list[Any]] = []  # [step, group_id] in the order applied, in this lineage
        self.pending: list[str] = []  # entry ids trained but not yet covered by a checkpoint (rank 0)
        self.checkpoint_step = 0  # the step of the newest checkpoint this process wrote (0: none yet)
        self.watchdog = Watchdog(float("inf"), "the learner's training loop")  # `start_watchdog` arms it

    async def run(self) -> None:
        await self.start()
        await self.resume()
        self.start_watchdog()
        try:
            await self.train()
            self.watchdog.tick("the run's end")
            await self.finish()
        finally:
            self.watchdog.stop()

    async def train(self) -> None:
        warmed = False
        while self.trainer.step < self.spec.train.steps:
            deliveries = await self.leader.collect() if self.leader is not None else []
            payloads = share_payloads(encode(deliveries), self.world)
            self.watchdog.tick(f"a read of the stream at step {self.trainer.step}")
            if payloads is None:
                break
            if payloads:
                await self.step(deliveries, payloads)
                if not warmed:  # after the first step (eager) and its publish: compiling overlaps the
                    await asyncio.to_thread(self.warm_up)  # replicas' generation of the next one
                    warmed = True

    def start_watchdog(self) -> None:
        """`config.stall_timeout_s`: ticked by each pass of the loop, each finished part of a step and each
        forward pass of the policy (a long step is progress); None leaves the idle one, which never fires."""
        timeout = self.config.stall_timeout_s
        if timeout is None:
            return
        loop = asyncio.get_running_loop()
        self.watchdog = Watchdog(timeout, "the learner's training loop", loop=loop).start()
        self.trainer.model.register_forward_pre_hook(lambda *_: self.watchdog.tick("a forward pass"))

    # --- set-up ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Collective restore; then rank 0 builds and starts its `Leader`."""
        self.ledger, self.applied_log = restore(self.trainer, self.paths)
        if self.world.is_main:
            self.leader = Leader(self.config, self.world, self.paths, self.trainer, self.ledger)
            await self.leader.start()

    async def resume(self) -> None:
        """Collective, after `start`. A restarted learner publishes the restored weights at once when the
        newest published version does not hold them, so the replicas move to the restored policy; hands
        back, as it reads them, the groups of the versions that rolled back; marks the restart in the
        metrics (`restart.plan_restart`, `rlfabric.contracts.lineage`)."""
        restart = await self.leader.plan_restart() if self.leader is not None else None
        publish = restart.plan.publish if restart is not None else None
        if broadcast_flag(publish is not None, self.world):
            if self.leader is not None and restart is not None:  # rank 0
                await self.leader.record_restart(restart)
            await self.publish_weights(publish or 0, restart.metadata if restart is not None else None)
        if self.leader is None or restart is None:
            return
        self.trainer.renumber(restart.plan.version)
        await self.leader.resumed(restart, len(self.ledger))

    # --- one step ----------------------------------------------------------------------------------

    async def step(self, deliveries: list[Delivery] | None, payloads: list[bytes]) -> None:
        messages = [wire.decode_group(p) for p in payloads]
        traced = [(c, m) for m in messages if (c := trace_parent(m)) is not None]
        attributes: dict[str, str | int] = {
            "run_id": self.config.run_id,
            "step": self.trainer.step + 1,
            "groups": len(messages),
        }
        with telemetry.span("learner.step", attributes=attributes, links=[c for c, _ in traced]):
            await self.train_publish_report(deliveries, [wire.group_samples_from_proto(m) for m in messages])
        for parent, message in traced:  # each group's own trace ends with the step that consumed it
            span_attributes: dict[str, str | int] = {"step": self.trainer.step, "group_id": message.group_id}
            with telemetry.span("learner.trained", parent=parent, attributes=span_attributes):
                pass

    async def train_publish_report(
        self, deliveries: list[Delivery] | None, groups: list[GroupSamples]
    ) -> None:
        """Steps 3-6 of the module docstring."""
        self.set_state(learner_pb2.LEARNER_STATE_TRAINING)
        start = time.perf_counter()
        metrics = await asyncio.to_thread(self.train_in_turn, groups)
        metrics.update(component_means(groups))
        metrics.update(trajectory_means(groups))
        metrics["step_seconds"] = time.perf_counter() - start
        metrics["memory_peak_bytes"] = float(peak_memory_bytes(self.trainer.device))
        self.ledger.update(g.group_id for g in groups)
        self.applied_log.extend([self.trainer.step, g.group_id] for g in groups)
        self.pending.extend(d.entry_id for d in deliveries or [])
        self.watchdog.tick(f"step {self.trainer.step} trained")
        failpoints.hit("learner.after_step")
        self.set_state(learner_pb2.LEARNER_STATE_PUBLISHING)
        await self.persist_if_due(metrics)
        self.watchdog.tick(f"step {self.trainer.step} persisted")
        await self.publish(metrics)
        self.watchdog.tick(f"step {self.trainer.step} published")
        if self.leader is not None:
            await self.leader.report(metrics, len(groups), len(self.ledger))

    def warm_up(self) -> None:
        """`Trainer.warm_up` (collective), in this learner's turn on its cores like a step."""
        with core_turn(self.config.compute_lock if self.world.is_main else None):
            self.trainer.warm_up()

    def train_in_turn(self, groups: list[GroupSamples]) -> dict[str, float]:
        """`Trainer.train_step`, in this learner's turn on its cores when it shares them
        (`config.compute_lock`, taken by rank 0 only); `core_wait_seconds` is the wait for the turn."""
        lock = self.config.compute_lock if self.world.is_main else None
        with core_turn(lock) as waited:
            metrics = self.trainer.train_step(groups)
        if lock is not None:
            metrics["core_wait_seconds"] = waited
        return metrics

    async def persist_if_due(self, metrics: dict[str, float]) -> None:
        due = (
            self.trainer.step % self.spec.train.checkpoint_every == 0
            or self.trainer.step >= self.spec.train.steps
        )
        if not due:
            return
        start = time.perf_counter()
        await asyncio.to_thread(self.checkpoint)
        if self.leader is not None and self.pending:
            failpoints.hit("learner.before_ack")
            await self.leader.ack(self.pending)
            self.pending = []
        metrics["checkpoint_seconds"] = time.perf_counter() - start
        metrics["checkpoint_step"] = self.trainer.step
        self.checkpoint_step = self.trainer.step
        if self.leader is not None:
            self.leader.checkpointed()

    async def publish(self, metrics: dict[str, float]) -> None:
        seconds = await self.publish_weights(self.trainer.policy_version, {"step": self.trainer.step})
        if self.leader is not None:
            metrics["publish_seconds"] = seconds

    async def publish_weights(self, version: int, metadata: dict[str, Any] | None = None) -> float:
        """Collective: gathers the full weights (or with `model.lora.publish = "adapter"` the adapter alone);
        rank 0 publishes them as `version` (returns its seconds)."""
        if self.spec.model.published_adapter is not None:
            adapter = await asyncio.to_thread(self.trainer.adapter_state_dict)
            if self.leader is None:
                return 0.0
            config = adapter_config(self.trainer.model)
            return await self.leader.publisher.publish_adapter(version, adapter, config, metadata)
        state_dict = drop_tied_head(
            self.trainer.model.config, await asyncio.to_thread(self.trainer.full_state_dict)
        )
        if self.leader is None:
            return 0.0
        return await self.leader.publisher.publish(version, state_dict, metadata)

    def set_state(self, state: int) -> None:
        """GetStatus's state (rank 0; a no-op elsewhere)."""
        if self.leader is not None:
            self.leader.set_state(state)

    def checkpoint(self) -> None:
        """Collective: a checkpoint with the ledger, keeping `train.keep_checkpoints` complete ones."""
        keep = self.spec.train.keep_checkpoints
        checkpoint(self.trainer, self.paths, self.ledger, self.applied_log, keep=keep)

    # --- the end -----------------------------------------------------------------------------------

    async def finish(self) -> None:
        """Collective: a final checkpoint and its acks, then the final model (neither after a health
        stop); rank 0 lets go."""
        health_stop = broadcast_flag(self.leader is not None and self.leader.health_stop, self.world)
        if health_stop:
            log.warning("stopped by a health check at step %d: no final checkpoint", self.trainer.step)
        elif self.trainer.step > 0:
            if self.checkpoint_step != self.trainer.step:
                await asyncio.to_thread(self.checkpoint)
                if self.leader is not None and self.pending:
                    await self.leader.ack(self.pending)
            await asyncio.to_thread(self.export)
        if self.leader is not None:
            await self.leader.close()

    def export(self) -> None:
        """Collective: rank 0 writes the policy (adapters merged) with the base model's config and
        tokenizer as `<run dir>/model`, replacing an older one (a run stopped, then resumed)."""
        state_dict = drop_tied_head(self.trainer.model.config, self.trainer.full_state_dict())
        if self.world.is_main:
            final = export_final_model(state_dict, self.spec.model.path, self.paths.run_dir)
            log.info("final model of step %d in %s", self.trainer.step, final)


def encode(deliveries: list[Delivery] | None) -> list[bytes] | None:
    """The deliveries' groups as protobuf bytes for `share_payloads` (None: stop)."""
    if deliveries is None:
        return None
    return [d.group.SerializeToString() for d in deliveries if d.group is not None]


def trace_parent(group: queue_pb2.ScoredGroup) -> otel_context.Context | None:
    """The trace context the coordinator stored with `group` (None when tracing is off or it has none)."""
    return telemetry.context_from_carrier(wire.trace_from_proto(group.trace))
