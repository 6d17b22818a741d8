"""RunStore.reopen, the way `rlfabric up --resume` takes a stopped or failed run back to pending: the stop
request, its reason, the error and the learner's stop flag are cleared, progress is kept; a completed run
is refused, a running one is left as it is."""

from __future__ import annotations

import fakeredis
import pytest

from rlfabric.coordinator.runs import InvalidTransition, RunStore
from rlfabric.runspec import RunSpec


@pytest.fixture
def store() -> RunStore:
    return RunStore(fakeredis.FakeAsyncRedis())


async def started(store: RunStore, name: str) -> None:
    spec = RunSpec.model_validate({"name": name, "model": {"path": "m"}, "dataset": {"path": "d.jsonl"}})
    await store.create(spec)
    await store.set_state(name, "running")
    await store.update_progress(name, 7, 7)


@pytest.mark.parametrize("final", ["stopped", "failed"])
async def test_a_stopped_or_failed_run_becomes_pending_again(store: RunStore, final: str) -> None:
    await started(store, "a")
    await store.request_stop("a")
    await store.redis.set("rlfabric:a:stop_requested", "stopped")
    await store.set_state("a", final, error="boom" if final == "failed" else None)  # type: ignore[arg-type]
    record = await store.reopen("a")
    assert (record.state, record.stop_requested, record.stop_reason, record.error) == (
        "pending",
        False,
        None,
        None,
    )
    assert (record.step, record.policy_version) == (7, 7)
    assert await store.redis.get("rlfabric:a:stop_requested") is None
    assert (await store.set_state("a", "running")).state == "running"


async def test_a_completed_run_is_not_reopened_and_a_running_one_is_left_alone(store: RunStore) -> None:
    await started(store, "b")
    assert (await store.reopen("b")).state == "running"
    await store.set_state("b", "completed")
    with pytest.raises(InvalidTransition, match="completed"):
        await store.reopen("b")
