"""The final policy's held-out evaluation: the learner, after publishing its last step's weights, asks
for it (`keys.final_eval`) and writes that step's row only once the coordinator's evaluator has answered,
so the run's last row carries the held-out reward of the policy it ends with (before, an evaluation due
at the last step ran after the last row and was never reported). The evaluator answers every request,
even with nothing to evaluate; the learner gives up on a stop request or after its timeout."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest

from rlfabric.contracts import keys
from rlfabric.coordinator.dataset import PromptRow
from rlfabric.coordinator.evaluation import Evaluator
from rlfabric.learner import leader as leader_module
from rlfabric.learner.leader import Leader
from rlfabric.reward.spec import ItemResult
from rlfabric.runspec import DatasetSpec, RunSpec
from rlfabric.v1 import rollout_pb2

RUN = "final"
ROWS = [PromptRow("a", "p a"), PromptRow("b", "p b")]


class FakePipeline:
    """Generation serves the newest published version (`version`); the learner's step is `step`."""

    run_id = RUN

    def __init__(self, redis: Any, every: int = 4) -> None:
        dataset = {"path": "d.jsonl", "held_out_fraction": 0.2, "eval_every_steps": every}
        self.spec = RunSpec.model_validate({"model": {"path": "m"}, "dataset": dataset})
        self.redis = redis
        self.step = 0
        self.version = 0
        self.dispatcher = self  # generates itself, as the pipeline's dispatcher would

    async def generate(self, item: Any, row: PromptRow, sampling: Any = None) -> list[Any]:
        return [rollout_pb2.GeneratedSample(sample_index=0, text="x", policy_version=self.version)]

    async def learner_step(self) -> int:
        return self.step

    async def count(self, counter: Any, n: int = 1) -> None: ...

    async def refused_as_too_long(self, row: PromptRow, reason: str) -> None: ...


async def score(row: PromptRow, samples: list[Any]) -> list[ItemResult]:
    return [ItemResult("0", 1.0, "ok", "", {}, "s", "1", 0.0)]


async def results(redis: Any) -> list[dict[str, Any]]:
    return [json.loads(r) for r in await redis.lrange(keys.eval_results(RUN), 0, -1)]


async def until(condition: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def fake_leader(redis: Any, step: int, stop: str | None = None) -> Any:
    async def stop_reason() -> str | None:
        return stop

    return SimpleNamespace(
        config=SimpleNamespace(run_id=RUN),
        redis=redis,
        trainer=SimpleNamespace(step=step),
        stop_reason=stop_reason,
    )


@pytest.fixture
def fast_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rlfabric.coordinator.evaluation.POLL_S", 0.02)
    monkeypatch.setattr(leader_module, "FINAL_EVAL_POLL_S", 0.02)


async def test_the_last_row_waits_for_the_final_policys_evaluation(fast_poll: None) -> None:
    redis = fakeredis.FakeAsyncRedis()
    pipeline = FakePipeline(redis)
    evaluator = asyncio.create_task(Evaluator(pipeline, score).run(ROWS, "held_out"))
    try:
        await until(lambda: _count(redis, 1))  # before the first step
        pipeline.step, pipeline.version = 5, 5  # step 4 was due: evaluated when the step reads 5
        await until(lambda: _count(redis, 2))
        pipeline.version = 6  # the last step (6) is published; its row is not written yet
        await Leader.final_evaluation(fake_leader(redis, 6))
        assert [(r["step"], r["policy_version"]) for r in await results(redis)] == [(0, 0), (5, 5), (6, 6)]
        assert not await redis.exists(keys.final_eval(RUN))
        row = await Leader.take_eval_results(fake_leader(redis, 6))
        assert (row["eval_step"], row["eval_policy_version"]) == (6, 6)  # the last row's
        pipeline.step = 6  # the row is written: no second evaluation of the same policy
        await asyncio.sleep(0.2)
        assert await redis.llen(keys.eval_results(RUN)) == 0
    finally:
        evaluator.cancel()


async def _count(redis: Any, n: int) -> bool:
    return int(await redis.llen(keys.eval_results(RUN))) >= n


async def test_a_request_with_nothing_to_evaluate_is_answered(fast_poll: None) -> None:
    redis = fakeredis.FakeAsyncRedis()
    evaluator = asyncio.create_task(Evaluator(FakePipeline(redis), score).run([], "none"))
    try:
        await asyncio.wait_for(Leader.final_evaluation(fake_leader(redis, 3)), timeout=5)
        assert await results(redis) == [] and not await redis.exists(keys.final_eval(RUN))
    finally:
        evaluator.cancel()


async def test_the_learner_gives_up_on_a_stop_or_after_its_timeout(
    fast_poll: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = fakeredis.FakeAsyncRedis()  # no coordinator answers
    await asyncio.wait_for(Leader.final_evaluation(fake_leader(redis, 3, stop="user")), timeout=5)
    assert not await redis.exists(keys.final_eval(RUN))
    monkeypatch.setattr(leader_module, "FINAL_EVAL_TIMEOUT_S", 0.1)
    await asyncio.wait_for(Leader.final_evaluation(fake_leader(redis, 3)), timeout=5)
    assert not await redis.exists(keys.final_eval(RUN))


def test_which_runs_evaluate() -> None:
    def dataset(**fields: Any) -> DatasetSpec:
        return DatasetSpec.model_validate({"path": "d.jsonl", **fields})

    assert dataset(held_out_fraction=0.1, eval_every_steps=5).evaluated
    assert dataset(eval={"path": "e.jsonl"}, eval_every_steps=5).evaluated
    assert not dataset(held_out_fraction=0.1).evaluated  # every 0: never
    assert not dataset(eval_every_steps=5).evaluated  # nothing held out


def test_up_prints_the_first_and_the_final_held_out_reward(tmp_path: Any) -> None:
    from rlfabric.local.watch import held_out_line

    metrics = tmp_path / "metrics.jsonl"
    assert held_out_line(metrics) == ""  # no run yet
    rows = [
        {"step": 1},
        {"step": 2, "eval_reward_mean": 0.0066, "eval_step": 0},
        {"step": 3, "eval_reward_mean": 0.25, "eval_step": 2},
        {"step": 4, "eval_reward_mean": 0.88, "eval_step": 4},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert held_out_line(metrics) == "held-out reward: 0.007 at step 0"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{torn")  # a row being written
    assert held_out_line(metrics) == "held-out reward: 0.007 at step 0 -> 0.880 at step 4"
