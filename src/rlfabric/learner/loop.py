"""The learner's main loop: read scored groups, train, checkpoint, acknowledge, publish.

    resume   restore the newest complete checkpoint (model, optimizer, RNG, step, applied-group ledger);
             after a restart, publish the restored weights at once under a new version when the newest
             published one does not hold them (the versions past the checkpoint are rolled back,
             `rlfabric.contracts.lineage`), and write a restart marker row in the metrics
    repeat until the run's step budget is spent:
      1. collect   rank 0 reads groups_per_step fresh groups (stale ones are dropped, recorded, acked;
                   those of rolled-back versions are handed back to the coordinator to generate again)
      2. share     rank 0 sends the groups' protobuf bytes to every rank (a byte tensor, never pickle)
      3. train     Trainer.train_step on every rank (FSDP2)
      4. persist   every checkpoint_every steps: checkpoint with the ledger, then ack the entries it covers
      5. publish   gather the full weights, write version v to the object store, announce it
      6. report    metrics.jsonl, Prometheus, LearnerService.GetStatus

Exactly-once: an entry is acknowledged only after a checkpoint that contains its group id in the ledger
is complete. A crash before that leaves it pending (redelivered, trained again on the restored model); a
crash after it leaves it in the restored ledger (skipped on redelivery).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Gauge

from rlfabric.contracts import keys, lineage
from rlfabric.contracts.keys import Counter
from rlfabric.contracts.lineage import HandBack, Lineage, ResumePlan
from rlfabric.contracts.metrics import append_row
from rlfabric.contracts.streams import drop_stale_once
from rlfabric.learner.batch import GroupSamples, Rollout
from rlfabric.learner.checkpoint import latest_complete, prune
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.dist import World
from rlfabric.learner.queue import AppliedLedger, Delivery, GroupConsumer
from rlfabric.learner.trainer import Trainer
from rlfabric.v1 import common_pb2, queue_pb2
from rlfabric.weights import versions as store

log = logging.getLogger(__name__)

_STEP_METRIC = Gauge("rlfabric_learner_step_metric", "Latest value of each learner step metric", ["name"])
LEDGER_KEY = "ledger"
APPLIED_LOG_KEY = "applied_log"
FINISH_NAMES = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_ABORT: "abort"}


def to_group_samples(group: queue_pb2.ScoredGroup) -> GroupSamples:
    rollouts = [
        Rollout(
            token_ids=list(s.token_ids),
            logprobs=list(s.logprobs),
            reward=s.reward.value,
            finish_reason=FINISH_NAMES.get(s.finish_reason, "stop"),
            policy_version=s.policy_version,
        )
        for s in sorted(group.samples, key=lambda s: s.sample_index)
    ]
    return GroupSamples(list(group.prompt_token_ids), rollouts, group.group_id)


STOP = -1
"""The payload count rank 0 sends to end the loop on every rank."""


def share_payloads(payloads: list[bytes] | None, world: World) -> list[bytes] | None:
    """Rank 0's list of byte strings on every rank (broadcasts of the count, the lengths, the bytes);
    None on every rank when rank 0 passes None (stop)."""
    if world.size == 1:
        return payloads
    import torch.distributed as dist

    device = world.device if world.backend == "nccl" else torch.device("cpu")
    count = torch.tensor([STOP if payloads is None else len(payloads)], dtype=torch.int64, device=device)
    dist.broadcast(count, src=0)
    if int(count) == STOP:
        return None
    payloads = payloads or []
    lengths = torch.tensor([len(p) for p in payloads] or [0] * int(count), dtype=torch.int64, device=device)
    if not world.is_main:
        lengths = torch.zeros(int(count), dtype=torch.int64, device=device)
    dist.broadcast(lengths, src=0)
    blob = torch.frombuffer(bytearray(b"".join(payloads)) or bytearray(1), dtype=torch.uint8).to(device)
    if not world.is_main:
        blob = torch.zeros(max(int(lengths.sum()), 1), dtype=torch.uint8, device=device)
    dist.broadcast(blob, src=0)
    data = blob.cpu().numpy().tobytes()
    offsets = [0, *torch.cumsum(lengths.cpu(), 0).tolist()]
    return [data[offsets[i] : offsets[i + 1]] for i in range(int(count))]


def broadcast_flag(flag: bool, world: World) -> bool:
    """Rank 0's `flag` on every rank (collective)."""
    if world.size == 1:
        return flag
    import torch.distributed as dist

    device = world.device if world.backend == "nccl" else torch.device("cpu")
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.broadcast(value, src=0)
    return bool(value.item())


@dataclass
class RunPaths:
    """Where a run's learner writes: checkpoints, published weights, metrics."""

    run_dir: Path
    weights_root: str

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @classmethod
    def of(cls, config: LearnerServiceConfig) -> RunPaths:
        run_dir = Path(config.run.output_dir) / config.run_id
        return cls(run_dir, config.run.weights.url or str(run_dir / "weights"))


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
            await self.drop_stale(delivery, lag)
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

    async def drop_stale(self, delivery: Delivery, lag: int) -> None:
        assert delivery.group is not None
        await drop_stale_once(self.redis, self.run_id, delivery.entry_id, delivery.group.group_id, lag)
        await self.consumer.ack([delivery.entry_id])  # acknowledged already: this clears the local record
        self.counters.dropped_stale += 1
        log.info("dropped stale group %s (lag %d)", delivery.group.group_id, lag)


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
        store.prune(self.paths.weights_root, keep=self.keep)
        await self.redis.set(keys.version(self.run_id), version)
        await self.redis.publish(keys.versions(self.run_id), version)
        return time.perf_counter() - start


@dataclass(frozen=True)
class Restart:
    """A learner resuming after an earlier life of this run (rank 0 decides, every rank publishes)."""

    plan: ResumePlan
    step: int
    """The restored checkpoint's step (0 without a checkpoint)."""
    checkpoint_version: int
    """The restored checkpoint's policy version (0 without a checkpoint: the base model)."""
    known: Lineage
    """The run's lineage as recorded before this restart."""
    time: float = field(default_factory=time.time)

    @property
    def record(self) -> lineage.RestoreRecord | None:
        """What the restore publish is, None when nothing is published."""
        if self.plan.publish is None:
            return None
        return lineage.RestoreRecord(
            self.plan.publish, self.step, self.checkpoint_version, self.plan.rolled_back, self.time
        )

    @property
    def lineage(self) -> Lineage:
        """The run's lineage with this restart's restore."""
        record = self.record
        return self.known if record is None else self.known.with_restore(record)

    @property
    def metadata(self) -> dict[str, Any]:
        """The restore publish's manifest metadata: which checkpoint and version its weights are."""
        return {"step": self.step, "restored_step": self.step, "weights_of": self.checkpoint_version}


async def plan_restart(redis: Any, run_id: str, publisher: Publisher, trainer: Trainer) -> Restart | None:
    """Rank 0, after `restore`: None on a fresh start (no checkpoint, nothing published), else what this
    restart publishes and rolls back. The newest version is the object store's or the announced one."""
    announced = int(await redis.get(keys.version(run_id)) or 0)
    latest = max(publisher.latest_published(), announced)
    if trainer.step == 0 and latest == 0:
        return None
    known = await lineage.load_lineage(redis, run_id)
    plan = lineage.plan_resume(
        known, step=trainer.step, checkpoint_version=trainer.policy_version, latest_published=latest
    )
    return Restart(plan, trainer.step, trainer.policy_version, known)


async def record_restart(redis: Any, run_id: str, restart: Restart) -> None:
    """Rank 0, before the restore publish: its record (first, so that a crash mid-publish leaves a record
    of a version the next restart publishes again, never a published version without one)."""
    record = restart.record
    if record is not None:
        await lineage.record_restore(redis, run_id, record)
        log.warning(
            "resumed from step %d: version %d = the weights of version %d; rolled back versions %s",
            restart.step, record.version, record.weights_of, record.rolled_back,
        )  # fmt: skip


async def mark_restart(redis: Any, run_id: str, paths: RunPaths, restart: Restart, trained: int) -> None:
    """Rank 0, once resumed: the run's step and trained-group count go back to the restored lineage's, and
    the restart marker row goes to metrics.jsonl and the metrics stream."""
    row = lineage.restart_row(restart.step, restart.plan.version)
    await redis.set(keys.step(run_id), restart.step)
    await redis.hset(keys.counters(run_id), Counter.GROUPS_TRAINED, trained)
    write_metrics(paths.metrics, row)
    await append_row(redis, run_id, row)


class StepExport:
    """Rank 0's per-step exports besides metrics.jsonl: TensorBoard event files under the run directory
    and Prometheus gauges (one per metric name, labelled, plus step and version)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.gauge = _STEP_METRIC

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for name, value in row.items():
            if isinstance(value, int | float) and name not in ("step", "time"):
                self.writer.add_scalar(name, value, step)
                self.gauge.labels(name).set(value)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def write_metrics(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def restore(trainer: Trainer, paths: RunPaths) -> tuple[AppliedLedger, list[list[Any]]]:
    """Resumes from the newest complete checkpoint, if any: the ledger and the applied log with it."""
    latest = latest_complete(paths.checkpoints)
    if latest is None:
        return AppliedLedger(), []
    extra = trainer.load_checkpoint(latest)
    log.info("resumed", extra={"checkpoint": str(latest), "step": trainer.step})
    return AppliedLedger.from_bytes(_as_bytes(extra[LEDGER_KEY])), json.loads(extra[APPLIED_LOG_KEY])


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def checkpoint(
    trainer: Trainer, paths: RunPaths, ledger: AppliedLedger, applied_log: list[list[Any]], keep: int = 2
) -> None:
    """Collective. The ledger (and the ordered log of applied groups, for audits) rides in the
    checkpoint, so acknowledging the entries afterwards is safe."""
    extra: dict[str, bytes | str] = {LEDGER_KEY: ledger.to_bytes(), APPLIED_LOG_KEY: json.dumps(applied_log)}
    trainer.save_checkpoint(paths.checkpoints, extra=extra)
    if trainer.world.is_main:
        prune(paths.checkpoints, keep=keep)
