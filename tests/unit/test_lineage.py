"""The lineage arithmetic of learner restarts (`rlfabric.contracts.lineage`), against hand-worked cases: which
versions a resume rolls back, what it publishes, which step each version holds, staleness across a
restore. The Redis side (the hand-back script) is proven on a real redis-server in
tests/integration/learner/test_learner_restart.py."""

from __future__ import annotations

from rlfabric.contracts.lineage import (
    RESTART_EVENT,
    Lineage,
    RestoreRecord,
    ResumePlan,
    inflight_record,
    plan_resume,
    redispatch_id,
    restart_row,
)


def restored(*records: RestoreRecord) -> Lineage:
    lineage = Lineage()
    for record in records:
        lineage = lineage.with_restore(record)
    return lineage


def test_a_crash_past_the_checkpoint_publishes_above_everything_and_rolls_the_rest_back() -> None:
    # checkpoint of step 10 (version 10); versions 11-13 were published before the crash
    plan = plan_resume(Lineage(), step=10, checkpoint_version=10, latest_published=13)
    assert plan == ResumePlan(publish=14, version=14, rolled_back=[11, 12, 13])


def test_nothing_is_published_when_the_newest_version_is_the_checkpoint() -> None:
    assert plan_resume(Lineage(), step=4, checkpoint_version=4, latest_published=4) == ResumePlan(None, 4, [])


def test_a_crash_between_checkpoint_and_publish_publishes_the_checkpoint_version() -> None:
    assert plan_resume(Lineage(), step=4, checkpoint_version=4, latest_published=3) == ResumePlan(4, 4, [])


def test_no_checkpoint_restores_the_base_model_over_every_published_version() -> None:
    assert plan_resume(Lineage(), step=0, checkpoint_version=0, latest_published=2) == ResumePlan(
        3, 3, [1, 2]
    )


def test_a_second_crash_before_any_step_keeps_the_first_restore() -> None:
    lineage = restored(RestoreRecord(14, 10, 10, [11, 12, 13]))
    plan = plan_resume(lineage, step=10, checkpoint_version=10, latest_published=14)
    assert plan == ResumePlan(None, 14, [])  # version 14 already holds step 10's weights


def test_a_restore_that_was_recorded_but_never_committed_is_published_again() -> None:
    lineage = restored(RestoreRecord(14, 10, 10, [11, 12, 13]))  # crashed before committing 14
    plan = plan_resume(lineage, step=10, checkpoint_version=10, latest_published=13)
    assert plan == ResumePlan(14, 14, [])  # 11-13 were rolled back already


def test_a_later_crash_rolls_back_only_the_new_versions() -> None:
    # after the restore 14 = step 10, steps 11 and 12 published 15 and 16, checkpoint at 12 (16), 17 lost
    lineage = restored(RestoreRecord(14, 10, 10, [11, 12, 13]))
    plan = plan_resume(lineage, step=12, checkpoint_version=16, latest_published=17)
    assert plan == ResumePlan(18, 18, [17])


def test_each_version_holds_its_step_across_restores() -> None:
    lineage = restored(RestoreRecord(14, 10, 10, [11, 12, 13]), RestoreRecord(18, 12, 16, [17]))
    assert [lineage.step_of(v) for v in (0, 9, 10, 14, 15, 16, 18, 19)] == [0, 9, 10, 10, 11, 12, 12, 13]
    assert lineage.rolled_back == {11, 12, 13, 17}
    assert lineage.is_rolled_back(12) and not lineage.is_rolled_back(14)


def test_staleness_counts_steps_of_the_lineage_not_version_numbers() -> None:
    lineage = restored(RestoreRecord(14, 10, 10, [11, 12, 13]))
    assert lineage.lag(14, 10) == 0  # the checkpoint's own samples are on-policy for its restore
    assert lineage.lag(14, 9) == 1
    assert lineage.lag(15, 10) == 1
    assert lineage.lag(15, 14) == 1


def test_a_redispatched_group_gets_a_new_id_each_time() -> None:
    assert redispatch_id("p3:e0") == "p3:e0:r1"
    assert redispatch_id("p3:e0:r1") == "p3:e0:r2"
    assert redispatch_id("p3:e0:r9") == "p3:e0:r10"


def test_records_round_trip_and_carry_the_agreed_fields() -> None:
    record = RestoreRecord(14, 10, 10, [11, 12, 13], 5.0)
    assert RestoreRecord.from_json(record.to_json()) == record
    row = restart_row(10, 14)
    assert set(row) == {"step", "event", "restored_step", "policy_version", "time"}
    assert (row["step"], row["event"], row["restored_step"], row["policy_version"]) == (
        10,
        RESTART_EVENT,
        10,
        14,
    )
    assert '"position": -1' in inflight_record("p:e0:r1", "p", 0)


def test_the_coordinator_health_checks_read_past_a_restart_marker() -> None:
    from rlfabric.coordinator.health import health_warnings, last_good_checkpoint

    steps = [
        {"step": s, "policy_version": s, "reward_mean": 0.5, "kl": 0.01, "entropy": 1.0} for s in (1, 2, 3)
    ]
    rows = [*steps, restart_row(2, 4), {**steps[-1], "policy_version": 5, "checkpoint_step": 3}]
    assert health_warnings(rows) == []
    assert last_good_checkpoint(rows, since_step=10, keep=2) == 3
