"""A run's generate -> score -> enqueue pipeline: the part of the coordinator that keeps engines busy.

    loop until the learner finishes, the prompts run out, or a stop is requested:
      1. admit     wait until the policy-lag bound allows another group in flight:
                   queued and not yet trained + in flight < (1 + max_staleness) * groups_per_step,
                   and no more than the steps left can train: < (steps - step) * groups_per_step
      2. draw      a prompt left in flight by a previous coordinator first, else the cursor's next
      3. dispatch  (`dispatch.Dispatcher`, which the held-out evaluation uses too) to the least-loaded
                   serving replica (discovered in the Redis registry), which admits it
                   only once it serves the learner's latest announced version (a run on a shared fleet:
                   to one of the fleet's replicas serving its adapter, when the fleet's scheduler grants
                   the run a slot by weighted fair share, `fleet.FleetScheduler`)
      4. score     the group's n completions in one Score call
      5. enqueue   the ScoredGroup, exactly once per group id (`streams.GroupProducer`: mark + XADD +
                   clear in-flight in one script), with backpressure on the undelivered backlog; or drop
                   it with a recorded reason

A replica that fails mid-generation is excluded for a while and the group is re-dispatched elsewhere
(counted). A prompt the replica refuses as invalid (INVALID_ARGUMENT naming `prompts[i]`: longer than the
context, empty) is dropped with the reason `prompt_too_long` or `invalid_prompt`, never retried and never
blamed on the replica.
Generated samples are held until they are enqueued: a reward service that fails is retried with backoff
(`score_retries`, and a warning in the run status while it lasts: `scoring.GroupScorer`), never answered
by generating again. Held-out evaluation runs beside the loop (`evaluation.Evaluator`).
Acknowledged stream entries are trimmed periodically (their summaries kept, see `streams.trim_acknowledged`).
Every drop is recorded in `keys.dropped` with its `DropReason`, so the books balance: each drawn
prompt is enqueued once, dropped with a reason, or still in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from rlfabric.contracts import keys, lineage, wire
from rlfabric.contracts.keys import Counter, DropReason
from rlfabric.contracts.streams import GroupProducer, ensure_consumer_group, undelivered
from rlfabric.contracts.trajectory import ENVIRONMENT_FAILURES, FAILED_STATUSES
from rlfabric.coordinator.dataset import PromptCursor, PromptRow, load_prompt_sets
from rlfabric.coordinator.dispatch import Dispatcher
from rlfabric.coordinator.evaluation import Evaluator
from rlfabric.coordinator.fleet import FleetLane, FleetScheduler
from rlfabric.coordinator.inflight import InFlight, InvalidPrompt, ReplicaFailed
from rlfabric.coordinator.replicas import ReplicaPool
from rlfabric.coordinator.runs import RunNotFound, RunState, RunStore
from rlfabric.coordinator.scaling import (
    BusyMeter,
    ScalingConfig,
    ScalingSignal,
    clear_scaling_gauges,
    export_queue_gauges,
    export_scaling_gauges,
    learner_queue,
    scaling_signal,
)
from rlfabric.coordinator.scoring import GroupScorer
from rlfabric.reward.spec import ItemResult
from rlfabric.runspec import RunSpec
from rlfabric.runtime import failpoints, telemetry
from rlfabric.runtime.aio import cancel_point
from rlfabric.v1 import queue_pb2, rollout_pb2

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 5.0
"""How often acknowledged entries are trimmed from the groups stream."""
ENQUEUE_POLL_S = 0.1
"""How often an enqueue waiting for room in the learner's backlog looks again."""
TOO_LONG_WARNING = "prompts too long for the context are dropped"
"""Start of the run-status warning shown once a prompt was refused as longer than `max_model_len -
max_tokens` (each such prompt is dropped with the reason `prompt_too_long` and never dispatched again)."""
# Each record and its counter change in one script, keyed by the group id, so neither a coordinator killed
# between two commands nor a command retried after its reply was lost (a Redis restart) leaves the books
# off by one.
# The enqueue is `streams.ENQUEUE_ONCE`.
# KEYS: dropped stream, dropped-id set, inflight-hash, counters; ARGV: group_id, prompt_id, reason, detail,
# counter.
DROP_ONCE = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[1], '*', 'group_id', ARGV[1], 'prompt_id', ARGV[2], 'reason', ARGV[3],
             'detail', ARGV[4])
  redis.call('HINCRBY', KEYS[4], ARGV[5], 1)
end
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""

# KEYS: cursor, inflight-hash, counters; ARGV: position, group_id, in-flight record, counter. Takes the
# prompt at `position` and records it in flight; a retry whose first call ran finds its own record and
# succeeds. 0: the cursor is elsewhere (read it again).
DRAW_AT = """
local taken = tonumber(redis.call('GET', KEYS[1]) or '0')
local position = tonumber(ARGV[1])
if taken == position + 1 and redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  return 1
end
if taken ~= position then
  return 0
end
redis.call('SET', KEYS[1], position + 1)
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""


def trajectory_counts(samples: list[rollout_pb2.GeneratedSample]) -> dict[Counter, int]:
    """What a multi-turn group adds to the run's counters."""
    trajectories = [s.trajectory for s in samples]
    statuses = [wire.trajectory_status_from_proto(t.status) for t in trajectories]
    return {
        Counter.TRAJECTORIES: len(trajectories),
        Counter.TRAJECTORY_TURNS: sum(
            sum(wire.turn_role_from_proto(turn.role) == "model" for turn in t.turns) for t in trajectories
        ),
        Counter.TRAJECTORIES_TRUNCATED: statuses.count("truncated"),
        Counter.ENVIRONMENT_ERRORS: sum(status in ENVIRONMENT_FAILURES for status in statuses),
        Counter.TEMPLATE_MISMATCHES: statuses.count("template_mismatch"),
        Counter.TOOL_CALLS: sum(t.tool_calls for t in trajectories),
        Counter.TOOL_ERRORS: sum(t.tool_errors for t in trajectories),
        Counter.PREFIX_PROMPT_TOKENS: sum(t.prompt_tokens for t in trajectories),
        Counter.PREFIX_CACHED_TOKENS: sum(t.cached_prompt_tokens for t in trajectories),
    }


class RunPipeline:
    """Everything one run's pipeline needs; `run()` returns the run's final state."""

    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        redis: Any,
        reward_address: str,
        max_stream_length: int,
        scaling: ScalingConfig | None = None,
        *,
        reward_token: str | None = None,
        rollout_token: str | None = None,
        fleet: FleetScheduler | None = None,
    ) -> None:
        self.run_id, self.spec, self.redis = run_id, spec, redis
        self.scaling = scaling or ScalingConfig()
        self.meter = BusyMeter(self.scaling.window_s)
        self.replicas = self.rollout_slots(fleet, rollout_token)
        self.dispatcher = Dispatcher(run_id, spec, redis, self.replicas)
        self.producer = GroupProducer(redis, run_id, max_stream_length, poll_s=ENQUEUE_POLL_S)
        self.in_flight: dict[str, asyncio.Task[None]] = {}
        self.drop_once = redis.register_script(DROP_ONCE)
        self.draw_at = redis.register_script(DRAW_AT)
        self.rows: dict[str, PromptRow] = {}
        self.too_long: set[str] = set()
        """Training prompt ids a replica refused as too long: never dispatched again."""
        self.store = RunStore(redis)
        self.scorer = GroupScorer(
            run_id, spec, self.store, reward_address, self.count_score_retry, token=reward_token
        )
        self.gold_scorer: GroupScorer | None = None
        """The evaluation's gold reward (`dataset.eval.reward`), scored through the same service."""
        if spec.dataset.eval.reward is not None:
            self.gold_scorer = GroupScorer(
                run_id, spec, self.store, reward_address, self.count_score_retry,
                token=reward_token, reward=spec.dataset.eval.reward,
            )  # fmt: skip
        gold = self.gold_scorer.score if self.gold_scorer is not None else None
        self.evaluator = Evaluator(self, self.scorer.score, gold)

    def rollout_slots(self, fleet: FleetScheduler | None, token: str | None) -> ReplicaPool | FleetLane:
        """Where the run generates: the run's own replicas, or its lane on the shared fleet its spec names
        (`fleet`: the coordinator's scheduler of that fleet, shared with the fleet's other runs; one of the
        pipeline's own when not given)."""
        rollout = self.spec.rollout
        if rollout.fleet is None:
            return ReplicaPool(
                self.redis, self.run_id, rollout.max_in_flight_per_replica, self.meter, token=token
            )
        scheduler = fleet or FleetScheduler(self.redis, rollout.fleet, self.scaling, token=token)
        return scheduler.lane(
            self.run_id,
            rollout.fleet_weight,
            rollout.max_in_flight_per_replica,
            self.admit_bound,
            self.meter,
            burst=self.spec.train.groups_per_step,
        )

    # --- bookkeeping ------------------------------------------------------------------------------

    async def count(self, counter: Counter, n: int = 1) -> None:
        await self.redis.hincrby(keys.counters(self.run_id), counter.value, n)

    async def drop(self, item: InFlight, reason: DropReason, detail: str = "") -> None:
        """Records the group as dropped and counts it, once (`DROP_ONCE`); clears its in-flight record."""
        run = self.run_id
        names = [keys.dropped(run), keys.dropped_ids(run), keys.inflight(run), keys.counters(run)]
        args = [item.group_id, item.prompt_id, reason.value, detail, reason.counter.value]
        await self.drop_once(keys=names, args=args)

    async def count_score_retry(self) -> None:
        await self.count(Counter.SCORE_RETRIES)

    async def learner_step(self) -> int:
        return int(await self.redis.get(keys.step(self.run_id)) or 0)

    # --- the loop ---------------------------------------------------------------------------------

    async def run(self, stop: Callable[[], Awaitable[bool]]) -> RunState:
        sets = await asyncio.to_thread(load_prompt_sets, self.spec.dataset)  # other runs go on meanwhile
        log.info(
            "run %s: %d training prompts, %d evaluation prompts (%s)",
            self.run_id, len(sets.train), len(sets.evaluation), sets.eval_source,
        )  # fmt: skip
        self.rows = {r.prompt_id: r for r in sets.train}
        cursor = PromptCursor(self.redis, self.run_id, sets.train, self.spec.dataset)
        await ensure_consumer_group(self.redis, self.run_id)
        loop = asyncio.get_running_loop()
        helpers = [
            loop.create_task(self.replicas.watch()),
            loop.create_task(self.evaluator.run(sets.evaluation, sets.eval_source)),
            loop.create_task(self.export_scaling_periodically()),
            loop.create_task(self.trim_periodically()),
        ]
        try:
            return await self.dispatch_loop(cursor, stop)
        finally:
            for helper in helpers:
                helper.cancel()
            clear_scaling_gauges(self.run_id)
            for task in self.in_flight.values():
                task.cancel()
            await self.replicas.close()
            await self.scorer.close()
            if self.gold_scorer is not None:
                await self.gold_scorer.close()

    async def dispatch_loop(self, cursor: PromptCursor, stop: Callable[[], Awaitable[bool]]) -> RunState:
        pending = await self.leftovers()
        exhausted = False
        while True:
            cancel_point()
            if await stop():
                return RunState.STOPPED
            step = await self.learner_step()
            if step >= self.spec.train.steps:
                return RunState.COMPLETED
            if exhausted and not self.in_flight and await self.drained():
                return RunState.COMPLETED
            if not await self.admits(step):
                await asyncio.sleep(0.05)
                continue
            item = pending.pop(0) if pending else await self.handed_back()
            if item is None and not exhausted:
                item = await self.draw(cursor)
                exhausted = item is None
            if item is None:
                await asyncio.sleep(0.05)
                continue
            self.in_flight[item.group_id] = asyncio.get_running_loop().create_task(self.process(item))

    @property
    def admit_bound(self) -> int:
        """Groups the policy-lag bound lets be in flight or queued unread: (max_staleness + 1) steps."""
        return (1 + self.spec.rollout.max_staleness) * self.spec.train.groups_per_step

    def groups_wanted(self, step: int) -> int:
        """The most groups worth having in flight or queued when the learner has trained `step` steps:
        the policy-lag bound, and no more than the steps left can train. Near a run's end a group past
        that would only be generated, scored and left untrained (a drop, not a loss, but engine time
        taken from the final evaluation and, on a shared fleet, from the other runs)."""
        left = max(0, self.spec.train.steps - step) * self.spec.train.groups_per_step
        return min(self.admit_bound, left)

    async def admits(self, step: int) -> bool:
        """Policy-lag bound: groups in flight plus groups queued and not yet trained or dropped by the
        learner stay within (max_staleness + 1) steps' worth, so every admitted group is trained within
        that many steps of the version it is generated with (which `generate` makes the latest one).
        A group the learner is training still counts: with max_staleness 0, generation of step t+1
        starts only once step t is trained and published (synchronous on-policy). And within the steps
        left (`groups_wanted`): a group the coordinator drops (one reward for all, a scorer failure) or
        the learner drops (stale) leaves the count, so the last step still gets its groups."""
        return len(self.in_flight) + await self.queued_untrained() < self.groups_wanted(step)

    async def queued_untrained(self) -> int:
        """Groups enqueued that the learner has neither trained (in its current lineage) nor dropped nor
        handed back (a restarted learner's rolled-back groups, `rlfabric.contracts.lineage`)."""
        names = [Counter.GROUPS_QUEUED, Counter.GROUPS_TRAINED, Counter.DROPPED_STALE, Counter.DEAD_LETTERED]
        raw = await self.redis.hmget(keys.counters(self.run_id), [*names, Counter.ROLLED_BACK])
        queued, trained, stale, dead, rolled_back = (int(v or 0) for v in raw)
        return max(0, queued - trained - stale - dead - rolled_back)

    async def drained(self) -> bool:
        """Everything enqueued has been trained or dropped by the learner (nothing left to wait for)."""
        return await undelivered(self.redis, self.run_id, cap=1) == 0

    async def leftovers(self) -> list[InFlight]:
        """Groups a previous coordinator drew but never finished: re-dispatched first."""
        raw = await self.redis.hgetall(keys.inflight(self.run_id))
        items = [InFlight(**json.loads(v)) for v in raw.values()]
        if items:
            await self.count(Counter.REDISPATCHES, len(items))
        return sorted(items, key=lambda i: (i.epoch, i.position))

    async def handed_back(self) -> InFlight | None:
        """A group a restarted learner handed back (generated by a version it rolled back), already
        recorded in flight by the learner: dispatched again before new prompts, after the leftovers. One
        a restarted coordinator took as a leftover is not taken twice."""
        while (record := await lineage.take_handed_back(self.redis, self.run_id)) is not None:
            if record["group_id"] not in self.in_flight:
                return InFlight(**record)
        return None

    async def draw(self, cursor: PromptCursor) -> InFlight | None:
        """The cursor's next prompt, taken and recorded in flight in one script (DRAW_AT)."""
        while True:
            cancel_point()
            taken, draw = await cursor.next()
            if draw is None:
                return None
            prompt_id = draw.row.prompt_id
            item = InFlight(f"{prompt_id}:e{draw.epoch}", prompt_id, draw.epoch, draw.position)
            names = [cursor.key, keys.inflight(self.run_id), keys.counters(self.run_id)]
            args = [taken, item.group_id, json.dumps(asdict(item)), Counter.PROMPTS_DISPATCHED.value]
            if await self.draw_at(keys=names, args=args):
                return item

    # --- one group --------------------------------------------------------------------------------

    async def process(self, item: InFlight) -> None:
        """Takes one group to its outcome. Its samples, once generated, are held across failures of the
        later phases (scoring, enqueueing), which are retried: a group is generated again only when its
        replica fails mid-generation."""
        row = self.rows[item.prompt_id]
        samples: list[rollout_pb2.GeneratedSample] | None = None
        while True:
            cancel_point()
            try:
                with telemetry.span(
                    "group", parent=telemetry.NEW_TRACE, attributes=self.group_attributes(item)
                ):
                    if samples is None:
                        samples = await self.generate_group(item, row)
                        failpoints.hit("coordinator.after_generate")  # the fault tests' kill or hang
                    if samples:  # [] when dropped as invalid
                        scores = await self.scorer.score_held(row, samples, item.epoch)
                        await self.finish_group(item, row, samples, scores)
                break
            except Exception:
                log.exception("group %s failed; it stays in flight and is retried", item.group_id)
                await asyncio.sleep(1.0)
        self.in_flight.pop(item.group_id, None)

    def group_attributes(self, item: InFlight) -> dict[str, str | int]:
        return {"run_id": self.run_id, "group_id": item.group_id}

    async def generate_group(self, item: InFlight, row: PromptRow) -> list[rollout_pb2.GeneratedSample]:
        """The group's samples, re-dispatched while replicas fail; [] when the prompt was dropped as
        invalid (recorded with the reason `invalid_prompt`, or `prompt_too_long`)."""
        if item.prompt_id in self.too_long:
            await self.drop(item, DropReason.PROMPT_TOO_LONG, "refused before as too long for the context")
            return []
        while True:
            cancel_point()
            try:
                samples = await self.dispatcher.generate(item, row)
                break
            except ReplicaFailed as exc:
                item.attempts += 1
                await self.count(Counter.REDISPATCHES)
                log.warning("re-dispatching %s: %s", item.group_id, exc)
            except InvalidPrompt as exc:
                if exc.too_long:
                    await self.refused_as_too_long(row, str(exc))
                    await self.drop(item, DropReason.PROMPT_TOO_LONG, str(exc)[:500])
                    return []
                log.warning("dropping %s: the replica refused its prompt: %s", item.group_id, exc)
                await self.drop(item, DropReason.INVALID_PROMPT, str(exc)[:500])
                return []
        await self.count(Counter.SAMPLES_GENERATED, len(samples))
        if self.spec.environment is not None:
            return await self.check_trajectories(item, samples)
        return samples

    async def check_trajectories(
        self, item: InFlight, samples: list[rollout_pb2.GeneratedSample]
    ) -> list[rollout_pb2.GeneratedSample]:
        """Counts a multi-turn group's trajectories (turns, tool calls, prefix-cache hits, truncations,
        environment failures, template mismatches); [] when one failed (the group is dropped with the reason
        `environment_error`: an environment failure is never a reward of 0) or has no token at all (the
        prompt leaves no room in the context: `prompt_too_long`)."""
        counts = trajectory_counts(samples)
        for counter, n in counts.items():
            await self.count(counter, n)
        failed = [
            s for s in samples if wire.trajectory_status_from_proto(s.trajectory.status) in FAILED_STATUSES
        ]
        if failed:
            t = failed[0].trajectory
            status = wire.trajectory_status_from_proto(t.status)
            await self.drop(item, DropReason.ENVIRONMENT_ERROR, f"{status}: {t.message}"[:500])
            return []
        if any(not s.token_ids for s in samples):
            await self.drop(item, DropReason.PROMPT_TOO_LONG, "the environment's prompt fills the context")
            return []
        return samples

    async def refused_as_too_long(self, row: PromptRow, reason: str) -> None:
        """Remembers a prompt a replica refused as too long (it is never dispatched again), logs it, and
        puts the run-status warning up (once)."""
        self.too_long.add(row.prompt_id)
        log.warning("prompt %s is too long and is dropped: %s", row.prompt_id, reason)
        sampling, context = self.spec.rollout.sampling, self.spec.model.max_model_len
        warning = (
            f"{TOO_LONG_WARNING}: longer than model.max_model_len {context} - rollout.sampling.max_tokens "
            f"{sampling.max_tokens} tokens (counters {Counter.DROPPED_PROMPT_TOO_LONG}, "
            f"{Counter.EVAL_PROMPTS_TOO_LONG})"
        )
        with contextlib.suppress(RunNotFound):
            await self.store.add_warning(self.run_id, warning)

    async def finish_group(
        self,
        item: InFlight,
        row: PromptRow,
        samples: list[rollout_pb2.GeneratedSample],
        scores: list[ItemResult],
    ) -> None:
        failed = [s for s in scores if s.status not in ("ok", "not_applicable")]
        if failed:
            await self.count(Counter.SCORER_ERRORS, len(failed))
            await self.drop(item, DropReason.SCORER_ERROR, failed[0].message[:500])
            return
        unscored = [s for s in scores if s.status == "not_applicable"]
        if unscored:  # no learning signal, as in TRL (which zeroes such samples' advantages)
            await self.drop(item, DropReason.NOT_APPLICABLE, unscored[0].message[:500])
            return
        rewards = {s.reward for s in scores}
        if self.spec.rollout.dynamic_sampling and len(rewards) == 1:
            await self.drop(item, DropReason.ZERO_VARIANCE)
            return
        group = self.build_group(item, samples, scores)
        await self.producer.append(group, timeout_s=None)

    def build_group(
        self, item: InFlight, samples: list[rollout_pb2.GeneratedSample], scores: list[ItemResult]
    ) -> queue_pb2.ScoredGroup:
        return wire.scored_group(
            run_id=self.run_id,
            prompt_id=item.prompt_id,
            group_id=item.group_id,
            epoch=item.epoch,
            samples=samples,
            scores=scores,
            trace=telemetry.trace_carrier(),
            enqueued_at=time.time(),
        )

    async def trim_acknowledged(self) -> int:
        """Trims every entry the learner has acknowledged (`GroupProducer.trim_acknowledged`)."""
        return await self.producer.trim_acknowledged()

    async def trim_periodically(self) -> None:
        """Keeps the groups stream (and Redis memory) from growing with the run."""
        while True:
            cancel_point()
            await asyncio.sleep(TRIM_INTERVAL_S)
            try:
                await self.trim_acknowledged()
            except Exception:  # tolerated: Redis restarting; the next interval trims what is left
                log.warning("could not trim the groups stream", exc_info=True)

    # --- the autoscaling signal -------------------------------------------------------------------

    def scaling_signal(self) -> ScalingSignal:
        return scaling_signal(
            self.meter,
            time.monotonic(),
            in_flight=sum(self.replicas.load.values()),
            backlog=self.replicas.waiting,
            per_replica=self.spec.rollout.max_in_flight_per_replica,
            admit_bound=self.admit_bound,
            config=self.scaling,
        )

    async def export_scaling_periodically(self) -> None:
        """Prometheus gauges and `keys.scaling` (read by the API, `rlfabric up` and the
        learner, which copies the busy fraction into its metrics rows)."""
        while True:
            cancel_point()
            await asyncio.sleep(self.scaling.interval_s)
            signal = self.scaling_signal()
            export_scaling_gauges(self.run_id, signal)
            try:
                fields = {k: str(v) for k, v in signal.as_dict().items()}
                await self.redis.hset(keys.scaling(self.run_id), mapping={**fields, "time": str(time.time())})
                export_queue_gauges(self.run_id, await learner_queue(self.redis, self.run_id))
            except Exception:  # tolerated: Redis restarting; the next interval writes again
                log.warning("could not store the scaling signal", exc_info=True)
