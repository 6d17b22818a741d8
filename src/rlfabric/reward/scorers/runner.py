"""Run a scorer over a batch with time limits, turning every failure into a per-item status.

`run_scorer` is what the service calls; it guarantees one result per item, in order, whatever the scorer
does: an exception becomes "scorer_error", a wrong-length answer becomes "scorer_error" for every item,
and an item still unscored at its deadline becomes "timeout".

Time limits are enforced here and not with signals, because the service scores on worker threads and
`signal.alarm` only works on the main thread. Python threads cannot be killed, so a scorer stuck past its
deadline is abandoned on a daemon thread: its result, if it ever comes, is dropped. Scorers whose items
can hang (`per_item = True`: math verification, code execution) are scored item by item on up to
`max_workers` threads (and at most the scorer's `item_threads`), so one slow item times out alone and a
replacement thread carries on with the rest.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence

from rlfabric.reward.scorers.base import ScoreInput, Scorer, ScoreResult, describe_exception


def safe_score_batch(scorer: Scorer, items: Sequence[ScoreInput]) -> list[ScoreResult]:
    """`scorer.score_batch(items)` with a batch-level exception or a wrong-length answer as errors."""
    try:
        results = list(scorer.score_batch(items))
    except Exception as exc:
        return [ScoreResult.error(f"scorer {scorer.name!r} failed: {describe_exception(exc)}")] * len(items)
    return check_length(scorer.name, items, results)


def check_length(name: str, items: Sequence[ScoreInput], results: list[ScoreResult]) -> list[ScoreResult]:
    if len(results) != len(items):
        message = f"scorer {name!r} returned {len(results)} results for {len(items)} items"
        return [ScoreResult.error(message)] * len(items)
    return results


def run_scorer(
    scorer: Scorer,
    items: Sequence[ScoreInput],
    timeout_s: float | None = None,
    *,
    item_timeout_s: float | None = None,
    max_workers: int = 8,
) -> list[ScoreResult]:
    """Score `items` within `timeout_s` for the whole call (and `item_timeout_s` per item, for per-item
    scorers); items unscored by then get status "timeout". Never raises for scorer faults."""
    items = list(items)
    if not items:
        return []
    if scorer.per_item:
        threads = min(max_workers, scorer.item_threads)
        return _PerItemRun(scorer, items, item_timeout_s).run(timeout_s, threads)
    return _run_whole_batch(scorer, items, timeout_s)


async def arun_scorer(
    scorer: Scorer,
    items: Sequence[ScoreInput],
    timeout_s: float | None = None,
    *,
    item_timeout_s: float | None = None,
    max_workers: int = 8,
) -> list[ScoreResult]:
    """`run_scorer` for an event loop: async-native scorers run on the loop, the rest on a thread."""
    items = list(items)
    if items and not scorer.per_item and type(scorer).ascore_batch is not Scorer.ascore_batch:
        return await _arun_native(scorer, items, timeout_s)
    return await asyncio.to_thread(
        run_scorer, scorer, items, timeout_s, item_timeout_s=item_timeout_s, max_workers=max_workers
    )


async def _arun_native(scorer: Scorer, items: list[ScoreInput], timeout_s: float | None) -> list[ScoreResult]:
    try:
        results = await asyncio.wait_for(scorer.ascore_batch(items), timeout_s)
    except TimeoutError:
        return [_batch_timeout(scorer, items, timeout_s)] * len(items)
    except Exception as exc:
        return [ScoreResult.error(f"scorer {scorer.name!r} failed: {describe_exception(exc)}")] * len(items)
    return check_length(scorer.name, items, list(results))


def _batch_timeout(scorer: Scorer, items: Sequence[ScoreInput], timeout_s: float | None) -> ScoreResult:
    return ScoreResult.timed_out(f"scorer {scorer.name!r} did not finish {len(items)} items in {timeout_s}s")


def _run_whole_batch(scorer: Scorer, items: list[ScoreInput], timeout_s: float | None) -> list[ScoreResult]:
    if timeout_s is None:
        return safe_score_batch(scorer, items)
    box: list[list[ScoreResult]] = []
    done = threading.Event()

    def work() -> None:
        box.append(safe_score_batch(scorer, items))
        done.set()

    threading.Thread(target=work, name=f"scorer-{scorer.name}", daemon=True).start()
    if done.wait(timeout_s):
        return box[0]
    return [_batch_timeout(scorer, items, timeout_s)] * len(items)


class _PerItemRun:
    """Items scored one by one on worker threads, with a deadline per item and one for the whole run.

    Invariant: `results[i]` is written once, under `cond`, by the worker that scored item i or by the
    supervisor (`run`) when its time is up; a late worker result for an expired item is dropped.
    """

    def __init__(self, scorer: Scorer, items: list[ScoreInput], item_timeout_s: float | None) -> None:
        self.scorer, self.items, self.item_timeout_s = scorer, items, item_timeout_s
        self.todo = deque(range(len(items)))
        self.results: list[ScoreResult | None] = [None] * len(items)
        self.started: dict[int, float] = {}
        self.cond = threading.Condition()
        self.closed = False

    def run(self, timeout_s: float | None, max_workers: int) -> list[ScoreResult]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for _ in range(min(max_workers, len(self.items))):
            self._spawn_worker()
        with self.cond:
            while not self._all_done() and not self._past(deadline):
                self._expire_hung_items()
                self.cond.wait(self._next_wake(deadline))
            self.closed = True
            return [r or self._unfinished(i) for i, r in enumerate(self.results)]

    def _spawn_worker(self) -> None:
        threading.Thread(target=self._work, name=f"scorer-{self.scorer.name}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self.cond:
                if self.closed or not self.todo:
                    return
                index = self.todo.popleft()
                self.started[index] = time.monotonic()
            result = safe_score_batch(self.scorer, [self.items[index]])[0]
            with self.cond:
                if self.started.pop(index, None) is None:
                    return  # expired while we worked: a replacement worker already took our place
                self.results[index] = result
                self.cond.notify_all()

    def _all_done(self) -> bool:
        return all(r is not None for r in self.results)

    @staticmethod
    def _past(deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() >= deadline

    def _expire_hung_items(self) -> None:
        if self.item_timeout_s is None:
            return
        now = time.monotonic()
        for index, start in list(self.started.items()):
            if now - start >= self.item_timeout_s:
                del self.started[index]
                self.results[index] = ScoreResult.timed_out(
                    f"scorer {self.scorer.name!r} did not finish the item in {self.item_timeout_s}s"
                )
                self._spawn_worker()

    def _next_wake(self, deadline: float | None) -> float | None:
        wakes = [] if deadline is None else [deadline]
        if self.item_timeout_s is not None:
            wakes += [start + self.item_timeout_s for start in self.started.values()]
        return max(0.0, min(wakes) - time.monotonic()) if wakes else None

    def _unfinished(self, index: int) -> ScoreResult:
        state = "did not finish" if index in self.started else "did not start"
        return ScoreResult.timed_out(
            f"scorer {self.scorer.name!r} {state} the item before the batch deadline"
        )
