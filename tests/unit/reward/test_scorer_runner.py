"""run_scorer / arun_scorer: one result per item, whatever the scorer does, within the time limits."""

import asyncio
import math
import threading
import time

from rlfabric.reward.scorers import ScoreInput, Scorer, ScoreResult, ScorerParams, arun_scorer, run_scorer

RELEASE = threading.Event()


class _Behaviour(Scorer):
    """Scores by the completion text: a number, "raise", or "hang" (waits for RELEASE)."""

    name = "test_behaviour"
    Params = ScorerParams

    def __init__(self) -> None:
        super().__init__(ScorerParams())

    def _score_one(self, item: ScoreInput) -> float:
        if item.completion == "raise":
            raise RuntimeError("scorer bug")
        if item.completion == "hang":
            RELEASE.wait(30)
        return float(item.completion) if item.completion != "hang" else -1.0


class _PerItem(_Behaviour):
    per_item = True


class _WrongLength(Scorer):
    name = "test_wrong_length"

    def score_batch(self, items):
        return [ScoreResult.ok(1.0)]


class _Async(Scorer):
    name = "test_async"

    async def ascore_batch(self, items):
        await asyncio.sleep(float(items[0].metadata.get("sleep", 0)))
        return [ScoreResult.ok(2.0) for _ in items]


def items_of(*completions):
    return [ScoreInput(id=str(i), prompt="", completion=c) for i, c in enumerate(completions)]


def test_exceptions_become_per_item_scorer_errors_never_zero():
    results = run_scorer(_Behaviour(), items_of("1", "raise", "0.5"))
    assert [r.status for r in results] == ["ok", "scorer_error", "ok"]
    assert math.isnan(results[1].reward) and "scorer bug" in results[1].message
    assert [results[0].reward, results[2].reward] == [1.0, 0.5]


def test_wrong_length_from_a_scorer_fails_every_item():
    results = run_scorer(_WrongLength(ScorerParams()), items_of("a", "b"))
    assert [r.status for r in results] == ["scorer_error", "scorer_error"]


def test_empty_batch():
    assert run_scorer(_Behaviour(), []) == []


def test_batch_timeout_marks_every_item():
    RELEASE.clear()
    start = time.monotonic()
    results = run_scorer(_Behaviour(), items_of("1", "hang"), timeout_s=0.3)
    RELEASE.set()
    assert time.monotonic() - start < 2
    assert [r.status for r in results] == ["timeout", "timeout"]
    assert math.isnan(results[0].reward)


def test_per_item_timeout_only_fails_the_slow_item():
    RELEASE.clear()
    start = time.monotonic()
    results = run_scorer(_PerItem(), items_of("1", "hang", "2", "3"), item_timeout_s=0.3, max_workers=1)
    RELEASE.set()
    assert time.monotonic() - start < 2
    assert [r.status for r in results] == ["ok", "timeout", "ok", "ok"]
    assert [results[i].reward for i in (0, 2, 3)] == [1.0, 2.0, 3.0]


def test_per_item_batch_deadline_reports_unstarted_items():
    RELEASE.clear()
    results = run_scorer(_PerItem(), items_of("hang", "1"), timeout_s=0.3, max_workers=1)
    RELEASE.set()
    assert [r.status for r in results] == ["timeout", "timeout"]
    assert "did not finish" in results[0].message and "did not start" in results[1].message


async def test_arun_scorer_native_async_and_timeout():
    assert [r.reward for r in await arun_scorer(_Async(ScorerParams()), items_of("a", "b"))] == [2.0, 2.0]
    slow = [ScoreInput(id="0", prompt="", completion="", metadata={"sleep": 5})]
    [result] = await arun_scorer(_Async(ScorerParams()), slow, timeout_s=0.2)
    assert result.status == "timeout"


async def test_arun_scorer_sync_scorer_runs_on_a_thread():
    results = await arun_scorer(_PerItem(), items_of("1", "raise"))
    assert [r.status for r in results] == ["ok", "scorer_error"]


class _CountsThreads(_PerItem):
    """Records how many items were being scored at once."""

    item_threads = 1
    lock = threading.Lock()
    active = 0
    peak = 0

    def _score_one(self, item: ScoreInput) -> float:
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        time.sleep(0.01)
        with cls.lock:
            cls.active -= 1
        return super()._score_one(item)


def test_item_threads_caps_concurrent_items_and_a_hung_item_still_times_out_alone():
    results = run_scorer(_CountsThreads(), items_of(*"12345678"), max_workers=8)
    assert [r.reward for r in results] == [float(c) for c in "12345678"]
    assert _CountsThreads.peak == 1
    RELEASE.clear()
    start = time.monotonic()
    results = run_scorer(_CountsThreads(), items_of("1", "hang", "2"), item_timeout_s=0.3, max_workers=8)
    RELEASE.set()
    assert time.monotonic() - start < 2
    assert [r.status for r in results] == ["ok", "timeout", "ok"]
