"""A run's separate evaluation set through the real pipeline (a reward service, a rollout replica on the
reference engine, a stand-in learner): evaluation results come from the eval set (its prompts, its
sampling), a final evaluation is answered when the learner asks for one, its rows are never dispatched
for training, and prompts too long for the context, in either set, are refused by a replica once, then
dropped (reason `prompt_too_long`, counted, warned about) without being dispatched again."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import redis.asyncio as aioredis
from test_pipeline import (  # the pipeline test's processes and stand-in learner
    REWARD_TOKEN,
    ROLLOUT_TOKEN,
    RUN,
    assert_books_balance,
    fake_learner,
    reward_address,  # noqa: F401 (a fixture)
    start_replica,
    wait_until,
)

from rlfabric.contracts import keys
from rlfabric.contracts.keys import Counter, DropReason
from rlfabric.coordinator.pipeline import TOO_LONG_WARNING, RunPipeline
from rlfabric.coordinator.runs import RunStore
from rlfabric.runspec import RunSpec

LONG = "x" * 3000  # the tiny model's tokenizer is character-level; the replica's context is 2048


def spec(tmp_path: Path, model: Path) -> RunSpec:
    train = tmp_path / "train.jsonl"
    rows = [{"id": f"t{i}", "prompt": f"say {i}"} for i in range(8)] + [{"id": "t-long", "prompt": LONG}]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    test = tmp_path / "test.jsonl"
    evals = [
        {"id": "e0", "prompt": "eval zero"},
        {"id": "e1", "prompt": "eval one"},
        {"id": "e2", "prompt": LONG},
    ]
    test.write_text("".join(json.dumps(r) + "\n" for r in evals))
    return RunSpec.model_validate(
        {
            "name": RUN,
            "model": {"path": str(model)},
            "dataset": {
                "path": str(train),
                "reference_field": None,
                "epochs": 100,
                "system_prompt": "be brief",
                "chat_template_kwargs": {"enable_thinking": False},
                "eval_every_steps": 2,
                "eval": {"path": str(test), "n": 1, "temperature": 0.0},
            },
            "rollout": {"sampling": {"n": 2, "max_tokens": 8}, "max_staleness": 3},
            "reward": {"scorer": "length_penalty", "params": {"target_length": 4}},
            "train": {"steps": 10_000, "groups_per_step": 4},
        }
    )


async def test_eval_results_come_from_the_eval_set(
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    reward_address: str,  # noqa: F811
) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    replica, _ = start_replica(tmp_path, tiny_model_dir, redis_url, "rollout-a")
    run_spec = spec(tmp_path, tiny_model_dir)
    await RunStore(redis).create(run_spec)
    stop, done = asyncio.Event(), asyncio.Event()
    pipeline = RunPipeline(
        RUN,
        run_spec,
        redis,
        reward_address,
        max_stream_length=64,
        reward_token=REWARD_TOKEN,
        rollout_token=ROLLOUT_TOKEN,
    )

    async def stop_requested() -> bool:
        return stop.is_set()

    run = asyncio.get_running_loop().create_task(pipeline.run(stop_requested))
    learner = asyncio.get_running_loop().create_task(fake_learner(redis, done))
    try:
        await wait_until(lambda: _evaluations(redis, 2))
        await wait_until(lambda: _dropped_too_long(redis, 2))  # two epochs: the long prompt each time
        await redis.set(keys.final_eval(RUN), 9_999)  # as the learner asks after publishing its last step
        await wait_until(lambda: _answered(redis))
        final = json.loads(await redis.lindex(keys.eval_results(RUN), -1))  # type: ignore[arg-type]
        assert (final["step"], final["source"]) == (9_999, "eval_set"), final
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 120) == "stopped"
        done.set()
        await learner
        replica.stop()
    results = [json.loads(r) for r in await redis.lrange(keys.eval_results(RUN), 0, -1)]
    assert all(r["source"] == "eval_set" for r in results)
    assert all((r["prompts"], r["samples"]) == (2, 2) for r in results), results  # e0, e1 once each (n=1)
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters(RUN))).items()}
    assert counters[Counter.EVAL_PROMPTS_TOO_LONG] == 1  # refused once, never evaluated again
    enqueued = {g.decode().split(":")[0] for g in await redis.smembers(keys.enqueued(RUN))}
    assert enqueued and enqueued <= {f"t{i}" for i in range(8)}  # never an eval row, never the long one
    drops = [fields for _, fields in await redis.xrange(keys.dropped(RUN))]
    assert {d[b"prompt_id"] for d in drops} == {b"t-long"}
    assert all(d[b"reason"] == DropReason.PROMPT_TOO_LONG.encode() for d in drops)
    record = await RunStore(redis).get(RUN)
    assert any(w.startswith(TOO_LONG_WARNING) for w in record.warnings)
    await assert_books_balance(redis)
    await redis.aclose()


async def _answered(redis: aioredis.Redis) -> bool:
    return not await redis.exists(keys.final_eval(RUN))


async def _evaluations(redis: aioredis.Redis, n: int) -> bool:
    return int(await redis.llen(keys.eval_results(RUN))) >= n


async def _dropped_too_long(redis: aioredis.Redis, n: int) -> bool:
    value = await redis.hget(keys.counters(RUN), Counter.DROPPED_PROMPT_TOO_LONG)
    return int(value or 0) >= n
