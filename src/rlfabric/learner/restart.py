"""What survives a learner restart, and what a restarted learner does about the versions it lost.

Every rank: `checkpoint` saves the applied-group ledger (and the ordered log of applied groups) inside the
trainer's checkpoint; `restore` reads both back from the newest complete one. Rank 0 then plans the
restart against the run's lineage (`rlfabric.contracts.lineage`): `plan_restart` decides whether the
restored weights are published again under a new version, `record_restart` records that restore before
its publish, and `mark_restart` writes the restart marker row once resumed.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.contracts import keys, lineage
from rlfabric.contracts.keys import Counter
from rlfabric.contracts.lineage import Lineage, ResumePlan
from rlfabric.contracts.metrics import append_row
from rlfabric.learner.checkpoint import latest_complete, prune
from rlfabric.learner.outputs import RunPaths, write_metrics
from rlfabric.learner.queue import AppliedLedger
from rlfabric.learner.trainer_base import TrainerBase

if TYPE_CHECKING:
    from rlfabric.learner.leader import Publisher

log = logging.getLogger(__name__)

LEDGER_KEY = "ledger"
APPLIED_LOG_KEY = "applied_log"


# -- every rank: the ledger in the checkpoint -------------------------------------------------------------


def restore(trainer: TrainerBase[Any], paths: RunPaths) -> tuple[AppliedLedger, list[list[Any]]]:
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
    trainer: TrainerBase[Any],
    paths: RunPaths,
    ledger: AppliedLedger,
    applied_log: list[list[Any]],
    keep: int = 2,
) -> None:
    """Collective. The ledger (and the ordered log of applied groups, for audits) rides in the
    checkpoint, so acknowledging the entries afterwards is safe."""
    extra: dict[str, bytes | str] = {LEDGER_KEY: ledger.to_bytes(), APPLIED_LOG_KEY: json.dumps(applied_log)}
    trainer.save_checkpoint(paths.checkpoints, extra=extra)
    if trainer.world.is_main:
        prune(paths.checkpoints, keep=keep)


# -- rank 0: the restart against the run's lineage ---------------------------------------------------------


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


async def plan_restart(
    redis: Any, run_id: str, publisher: Publisher, trainer: TrainerBase[Any]
) -> Restart | None:
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
