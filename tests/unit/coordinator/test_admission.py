"""The pipeline's admission: the policy-lag bound, capped by the groups the steps left can train."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlfabric.coordinator.pipeline import RunPipeline
from rlfabric.runspec import RunSpec


def pipeline(steps: int, groups_per_step: int, max_staleness: int, queued: int = 0) -> RunPipeline:
    """A pipeline with only what admission reads: the spec, the groups in flight, the queued count."""
    raw: dict[str, Any] = {
        "model": {"path": "m"},
        "dataset": {"path": "d.jsonl"},
        "rollout": {"max_staleness": max_staleness},
        "train": {"steps": steps, "groups_per_step": groups_per_step},
    }
    run = RunPipeline.__new__(RunPipeline)
    run.spec = RunSpec.model_validate(raw)
    run.in_flight = {}

    async def queued_untrained() -> int:
        return queued

    run.queued_untrained = queued_untrained  # type: ignore[method-assign]
    return run


@pytest.mark.parametrize(
    ("step", "wanted"),
    [(0, 8), (8, 8), (9, 4), (10, 0), (12, 0)],  # 10 steps of 4 groups, one step of lag
)
def test_groups_wanted_is_the_lag_bound_within_the_steps_left(step: int, wanted: int) -> None:
    assert pipeline(steps=10, groups_per_step=4, max_staleness=1).groups_wanted(step) == wanted


def test_on_policy_wants_one_step_until_the_end() -> None:
    run = pipeline(steps=3, groups_per_step=2, max_staleness=0)
    assert [run.groups_wanted(step) for step in range(4)] == [2, 2, 2, 0]


def test_the_last_step_admits_only_what_it_still_lacks() -> None:
    """At step 9 of 10 with 3 of the last step's 4 groups queued, one more is admitted, then none."""
    run = pipeline(steps=10, groups_per_step=4, max_staleness=2, queued=3)
    assert asyncio.run(run.admits(9))
    run.in_flight["g"] = None  # type: ignore[assignment]
    assert not asyncio.run(run.admits(9))
    assert asyncio.run(run.admits(5))  # mid-run the lag bound (12) is what limits
