"""The reward service's domain: validate a scorer spec, score a batch within a deadline, count it.

No gRPC here: `rlfabric.reward.server` adapts this to the RewardService contract and the CLI uses it
in-process. Cheap scorers (`inline_scorers`: string compares, regexes, length arithmetic) run on a thread
of this process, because for them a process hop would cost more than the scoring; every other scorer
runs in the `ScorerPool` of worker processes so a slow or hung item never stalls the event loop.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Histogram

from rlfabric.reward.pool import ScorerPool
from rlfabric.reward.scorers import (
    SCORERS,
    InvalidScorerSpec,
    ScoreInput,
    Scorer,
    ScoreResult,
    arun_scorer,
    build_scorer,
    safe_score_batch,
)
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.spec import ScoredBatch as ScoredBatch
from rlfabric.reward.spec import ScorerProblem
from rlfabric.reward.spec import ScorerSpec as ScorerSpec

# Linear-time string arithmetic: scored on the event loop itself, where a thread hop would cost more than
# the scoring (user patterns, which can backtrack for ever, are not among them).
DIRECT_SCORERS = frozenset({"exact_match", "length_penalty", "overlong_penalty"})
# Built scorers kept for reuse, keyed by spec; a reward model held here is loaded once.
SCORER_CACHE_SIZE = 32

_ITEMS = Counter("rlfabric_reward_items_total", "Items scored, by scorer and status", ["scorer", "status"])
_BATCHES = Counter("rlfabric_reward_batches_total", "Score batches, by scorer", ["scorer"])
_BATCH_SECONDS = Histogram(
    "rlfabric_reward_batch_seconds",
    "Wall time of a Score batch, by scorer",
    ["scorer"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def scorer_version(spec: ScorerSpec) -> str:
    """ "name@version", and for a composite its parts' too, e.g. "composite@1[ok=math_verify@1]"."""
    own = f"{spec.name}@{SCORERS[spec.name].version}"
    if spec.name != "composite":
        return own
    parts = [f"{p['alias']}={p['scorer']}@{SCORERS[p['scorer']].version}" for p in spec.params["parts"]]
    return f"{own}[{','.join(parts)}]"


class RewardEngine:
    """Scores batches for the server and the CLI. Call `start()` inside the event loop first."""

    def __init__(
        self,
        *,
        workers: int,
        item_timeout_s: float,
        inline: Sequence[str],
        policy: ScorerPolicy | None = None,
    ) -> None:
        """`policy` (None: the default, no user code) governs every scorer built here and in the pool's
        workers."""
        self.item_timeout_s = item_timeout_s
        self.inline = frozenset(inline)
        self.policy = policy or ScorerPolicy()
        self.pool = ScorerPool(workers, self.policy)
        self._scorers: OrderedDict[str, Scorer] = OrderedDict()

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()
        for scorer in self._scorers.values():
            scorer.close()

    def resolve(self, spec: ScorerSpec) -> Scorer:
        """The built scorer for `spec`; raises `InvalidScorerSpec` naming the bad field."""
        scorer = self._scorers.pop(spec.key, None) or build_scorer(spec.name, spec.params, self.policy)
        self._scorers[spec.key] = scorer
        while len(self._scorers) > SCORER_CACHE_SIZE:
            self._scorers.popitem(last=False)[1].close()
        return scorer

    def check(self, spec: ScorerSpec) -> list[ScorerProblem]:
        """What is wrong with `spec` under this engine's policy ([] when it builds; the built scorer is
        kept for the Score calls that follow)."""
        try:
            self.resolve(spec)
        except InvalidScorerSpec as exc:
            return [ScorerProblem(exc.field, exc.reason)]
        return []

    def runs_inline(self, spec: ScorerSpec) -> bool:
        if spec.name == "composite":
            return all(part["scorer"] in self.inline for part in spec.params["parts"])
        return spec.name in self.inline

    async def score(
        self,
        spec: ScorerSpec,
        items: Sequence[ScoreInput],
        *,
        timeout_s: float,
        item_timeout_s: float | None = None,
    ) -> ScoredBatch:
        """One result per item, in order, within `timeout_s`. Raises `InvalidScorerSpec` for a bad spec;
        every scorer fault is an item status, never an exception."""
        scorer = self.resolve(spec)
        per_item = item_timeout_s or self.item_timeout_s
        start = time.perf_counter()
        if spec.name in DIRECT_SCORERS:
            results = safe_score_batch(scorer, items)  # microseconds per item: a thread hop costs more
        elif self.runs_inline(spec):
            results = await arun_scorer(scorer, items, timeout_s, item_timeout_s=per_item)
        else:
            payload = [item_to_json(item) for item in items]
            results = await self.pool.score(
                {"name": spec.name, "params": spec.params},
                payload,
                timeout_s=timeout_s,
                item_timeout_s=per_item,
                whole=scorer.whole_batch,
            )
        latency = time.perf_counter() - start
        record(spec.name, results, latency)
        return ScoredBatch(results, spec.name, scorer_version(spec), latency)


def item_to_json(item: ScoreInput) -> dict[str, Any]:
    """An item as the worker protocol's JSON object (no deep copy: it is encoded right away)."""
    return {
        "id": item.id,
        "prompt": item.prompt,
        "completion": item.completion,
        "reference": item.reference,
        "metadata": item.metadata,
        "completion_ids": item.completion_ids,
        "policy_version": item.policy_version,
        "epoch": item.epoch,
    }


def record(scorer: str, results: Sequence[ScoreResult], seconds: float) -> None:
    _BATCHES.labels(scorer).inc()
    _BATCH_SECONDS.labels(scorer).observe(seconds)
    for status, count in Tally(r.status for r in results).items():
        _ITEMS.labels(scorer, status).inc(count)
