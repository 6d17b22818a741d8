"""RunStore on an in-memory Redis (fakeredis): ids, transitions, counters, metrics; and the health checks
on synthetic metrics series."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest

from rlfabric.contracts.metrics import append_row
from rlfabric.coordinator.health import (
    HealthThresholds,
    HealthWarning,
    LengthLimit,
    check_entropy_collapse,
    check_no_signal,
    check_overfitting,
    check_response_length,
    check_reward_collapse,
    check_reward_hacking,
    check_rollout_mismatch,
    length_limit,
    run_health,
)
from rlfabric.coordinator.runs import COUNTERS, InvalidTransition, RunExists, RunNotFound, RunStore
from rlfabric.runspec import RunSpec


def spec(name: str | None = None) -> RunSpec:
    return RunSpec.model_validate({"name": name, "model": {"path": "m"}, "dataset": {"path": "d.jsonl"}})


@pytest.fixture
def store() -> RunStore:
    return RunStore(fakeredis.FakeAsyncRedis())


async def test_create_uses_the_name_or_a_generated_id(store: RunStore) -> None:
    named = await store.create(spec("alpha"))
    anonymous = await store.create(spec())
    assert named.run_id == "alpha" and named.state == "pending"
    assert anonymous.run_id.startswith("run-") and anonymous.spec.name == anonymous.run_id
    assert (await store.get("alpha")).spec == named.spec
    assert [r.run_id for r in await store.list()] == [anonymous.run_id, "alpha"]


async def test_create_refuses_a_taken_name(store: RunStore) -> None:
    await store.create(spec("alpha"))
    with pytest.raises(RunExists):
        await store.create(spec("alpha"))


async def test_unknown_run_is_not_found(store: RunStore) -> None:
    for call in (store.get("nope"), store.set_state("nope", "running"), store.request_stop("nope")):
        with pytest.raises(RunNotFound):
            await call
    with pytest.raises(RunNotFound):
        await store.stop_requested("nope")


async def test_legal_transitions(store: RunStore) -> None:
    await store.create(spec("a"))
    assert (await store.set_state("a", "running")).state == "running"
    assert (await store.set_state("a", "running")).state == "running"  # idempotent
    done = await store.set_state("a", "failed", error="boom")
    assert done.state == "failed" and done.error == "boom" and done.finished


@pytest.mark.parametrize("final", ["completed", "failed", "stopped"])
async def test_a_finished_run_never_changes_state(store: RunStore, final: str) -> None:
    await store.create(spec("a"))
    await store.set_state("a", "running")
    await store.set_state("a", final)  # type: ignore[arg-type]
    for target in ("pending", "running", "completed", "failed", "stopped"):
        with pytest.raises(InvalidTransition):
            await store.set_state("a", target)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransition):
        await store.request_stop("a")


async def test_pending_cannot_complete_or_go_back(store: RunStore) -> None:
    await store.create(spec("a"))
    with pytest.raises(InvalidTransition):
        await store.set_state("a", "completed")
    await store.set_state("a", "running")
    with pytest.raises(InvalidTransition):
        await store.set_state("a", "pending")


async def test_stop_of_a_pending_run_stops_it_and_of_a_running_one_flags_it(store: RunStore) -> None:
    await store.create(spec("p"))
    await store.create(spec("r"))
    await store.set_state("r", "running")
    assert (await store.request_stop("p")).state == "stopped"
    flagged = await store.request_stop("r")
    assert flagged.state == "running" and flagged.stop_requested
    assert await store.stop_requested("r") and await store.stop_requested("p")


async def test_progress_warnings_and_list_filter(store: RunStore) -> None:
    await store.create(spec("a"))
    await store.create(spec("b"))
    await store.set_state("b", "running")
    record = await store.update_progress("b", step=7, policy_version=8)
    assert (record.step, record.policy_version) == (7, 8)
    await store.add_warning("b", "w1")
    assert (await store.add_warning("b", "w1")).warnings == ["w1"]
    assert [r.run_id for r in await store.list(states={"running"})] == ["b"]
    assert len(await store.list(limit=1)) == 1


async def test_counters(store: RunStore) -> None:
    await store.create(spec("a"))
    assert await store.incr("a", "groups_queued") == 1
    assert await store.incr("a", "groups_queued", 4) == 5
    await store.incr("a", "custom", 2)
    counters = await store.counters("a")
    assert set(COUNTERS) <= set(counters)
    assert counters["groups_queued"] == 5 and counters["custom"] == 2 and counters["scorer_errors"] == 0


async def test_metrics_stream_round_trip(store: RunStore) -> None:
    await store.create(spec("a"))
    ids = [await append_row(store.redis, "a", {"step": s, "reward_mean": s / 10}) for s in (1, 2, 3)]
    rows = await store.metrics("a")
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["_id"] for r in rows] == ids
    assert [r["step"] for r in await store.metrics("a", since_id=ids[0])] == [2, 3]
    assert [r["step"] for r in await store.metrics("a", limit=1)] == [1]
    assert [r["step"] for r in await store.recent_metrics("a", 2)] == [2, 3]
    with pytest.raises(ValueError):
        await store.metrics("a", since_id="not-an-id")


# --- health -----------------------------------------------------------------------------------------------

T = HealthThresholds(window=5)


def said(warning: HealthWarning | None) -> str:
    return warning.message if warning else ""


def rows_of(**columns: list[float]) -> list[dict[str, Any]]:
    n = max(len(v) for v in columns.values())
    return [{"step": i + 1, **{k: v[i] for k, v in columns.items() if i < len(v)}} for i in range(n)]


def test_healthy_series_has_no_warnings() -> None:
    steady = rows_of(
        kl=[0.01] * 20,
        reward_mean=[0.3 + 0.005 * i for i in range(20)],
        entropy=[0.8] * 20,
        response_length_mean=[100.0] * 20,
        rollout_mismatch_kl=[1e-4] * 20,
    )
    assert run_health(steady, T, limit=LengthLimit(256, "rollout.sampling.max_tokens")) == []
    assert run_health([], T) == []


def test_reward_hacking_needs_kl_and_reward_to_jump_together() -> None:
    both = rows_of(kl=[0.01] * 5 + [0.05] * 5, reward_mean=[0.3] * 5 + [0.8] * 5)
    only_kl = rows_of(kl=[0.01] * 5 + [0.05] * 5, reward_mean=[0.3] * 10)
    only_reward = rows_of(kl=[0.01] * 10, reward_mean=[0.3] * 5 + [0.8] * 5)
    assert "reward hacking" in said(check_reward_hacking(both, T))
    assert check_reward_hacking(only_kl, T) is None
    assert check_reward_hacking(only_reward, T) is None
    assert check_reward_hacking(both[:9], T) is None  # too short


def test_reward_collapse_is_a_fall_from_the_best_earlier_window() -> None:
    """The agentic example at lr 1e-3: 0.83, 0.86, 0.91, 0.55, 0.16, then 0, with its entropy rising."""
    fell = rows_of(reward_mean=[0.83, 0.86, 0.91, 0.55, 0.16, 0.02, 0.0, 0.0, 0.0, 0.0])
    warning = check_reward_collapse(fell, T)
    assert warning is not None and warning.check == "reward_collapse" and warning.since_step == 6
    assert "fell 0.662 -> 0.004 (steps 1-5 vs the last 5)" in warning.message
    noisy = rows_of(reward_mean=[0.8, 0.9, 0.7, 0.95, 0.75, 0.6, 0.85, 0.9, 0.7, 0.8, 0.65, 0.9])
    rising = rows_of(reward_mean=[0.01 * i for i in range(40)])
    assert check_reward_collapse(noisy, T) is None  # the agentic example's spread at lr 2e-4
    assert check_reward_collapse(rising, T) is None
    assert check_reward_collapse(fell[:9], T) is None  # too short for two windows
    assert "reward collapse" in " ".join(run_health(fell, T))


def test_no_signal_is_uniform_groups_at_a_reward_that_did_not_rise() -> None:
    stuck = rows_of(reward_mean=[0.0] * 10, uniform_reward_groups_fraction=[1.0] * 10)
    warning = check_no_signal(stuck, T)
    assert warning is not None and warning.check == "no_signal" and warning.since_step == 6
    assert "no learning signal: 100% of the last 5 steps' groups" in warning.message
    assert "(0 at steps 1-5, 0 now)" in warning.message
    solved = rows_of(  # the demo's end: every group at reward 1 after a rise
        reward_mean=[0.01, 0.1, 0.3, 0.6, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0],
        uniform_reward_groups_fraction=[0.1, 0.0, 0.0, 0.2, 0.6, 1.0, 1.0, 1.0, 1.0, 1.0],
    )
    learning = rows_of(reward_mean=[0.8] * 10, uniform_reward_groups_fraction=[0.38] * 10)  # agentic, dynamic
    assert check_no_signal(solved, T) is None
    assert check_no_signal(learning, T) is None
    assert check_no_signal(stuck[:9], T) is None  # too short for two windows
    assert check_no_signal(rows_of(reward_mean=[0.0] * 10), T) is None  # one sample a prompt: no share
    assert "no learning signal" in " ".join(run_health(stuck, T))


def test_overfitting_train_up_eval_down() -> None:
    rows = rows_of(reward_mean=[0.2 + 0.05 * i for i in range(12)])
    for step, value in ((4, 0.5), (8, 0.45), (12, 0.4)):
        rows[step - 1]["eval_reward_mean"] = value
    assert "held-out reward fell" in said(check_overfitting(rows, T))
    for step, value in ((4, 0.4), (8, 0.45), (12, 0.5)):
        rows[step - 1]["eval_reward_mean"] = value
    assert check_overfitting(rows, T) is None


def test_entropy_collapse() -> None:
    assert "entropy collapse" in said(check_entropy_collapse(rows_of(entropy=[1.0] * 5 + [0.05] * 5), T))
    assert "below" in said(check_entropy_collapse(rows_of(entropy=[0.001] * 5), T))
    assert check_entropy_collapse(rows_of(entropy=[1.0] * 5 + [0.6] * 5), T) is None


def test_response_length_runaway_and_collapse() -> None:
    grow = rows_of(response_length_mean=[50.0] * 5 + [200.0] * 5)
    shrink = rows_of(response_length_mean=[100.0] * 5 + [10.0] * 5)
    near_limit = rows_of(response_length_mean=[250.0] * 5)
    assert "runaway" in said(check_response_length(grow, T))
    assert "collapse" in said(check_response_length(shrink, T))
    limit = LengthLimit(256, "rollout.sampling.max_tokens")
    assert "near rollout.sampling.max_tokens=256" in said(check_response_length(near_limit, T, limit))
    assert check_response_length(near_limit, T) is None


def run_spec(**sections: Any) -> RunSpec:
    return RunSpec.model_validate({"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}, **sections})


def test_the_length_limit_of_a_multi_turn_run_is_its_trajectory_budget() -> None:
    """A trajectory's response is every turn after the prompt (the agentic example's two turns: ~46
    tokens, with 48 a turn), so a model turn's max_tokens is no limit on it."""
    sampling = {"sampling": {"max_tokens": 48}}
    single = length_limit(run_spec(rollout=sampling))
    assert single == LengthLimit(48, "rollout.sampling.max_tokens")
    budget = length_limit(run_spec(rollout=sampling, environment={"max_total_tokens": 160}))
    assert budget == LengthLimit(160, "environment.max_total_tokens")
    assert length_limit(run_spec(rollout=sampling, environment={})) is None  # up to max_model_len
    two_turns = rows_of(response_length_mean=[46.0] * 5)
    assert "runaway" in said(check_response_length(two_turns, T, single))
    assert check_response_length(two_turns, T, budget) is None


def test_rollout_mismatch_above_the_bound_or_drifting() -> None:
    high = rows_of(rollout_mismatch_kl=[0.2] * 5)
    drift = rows_of(rollout_mismatch_kl=[1e-3] * 5 + [0.02] * 5)
    drift_from_nothing = rows_of(rollout_mismatch_kl=[1e-6] * 5 + [1e-4] * 5)
    assert "nats/token" in said(check_rollout_mismatch(high, T))
    assert "drifting" in said(check_rollout_mismatch(drift, T))
    assert check_rollout_mismatch(drift_from_nothing, T) is None  # 100x, but below the floor
    assert check_rollout_mismatch(high[:4], T) is None  # too short
    assert check_rollout_mismatch(high, HealthThresholds(window=5, mismatch_kl_max=0.5)) is None


def test_thresholds_are_configurable() -> None:
    rows = rows_of(kl=[0.01] * 5 + [0.03] * 5, reward_mean=[0.3] * 5 + [0.5] * 5)
    assert check_reward_hacking(rows, T) is not None
    assert check_reward_hacking(rows, HealthThresholds(window=5, kl_jump_factor=5.0)) is None
