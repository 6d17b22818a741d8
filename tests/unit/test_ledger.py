"""The ledger check on hand-made books (fakeredis + a checkpoint folder written here): a run whose books
balance passes with every outcome counted, and each way books can fail to balance is reported."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import fakeredis
import pytest

from rlfabric.contracts import keys
from rlfabric.contracts.keys import CONSUMER_GROUP
from rlfabric.contracts.lineage import (
    RestoreRecord,
    redispatch_id,
    restart_row,
)
from rlfabric.contracts.streams import trim_acknowledged
from rlfabric.tools.ledger import (
    IN_FLIGHT,
    ROLLED_BACK,
    TRAINED,
    LedgerViolation,
    check,
    read_books,
    reconcile,
)
from rlfabric.v1 import common_pb2, queue_pb2

RUN = "books"
BASE = f"rlfabric:{RUN}"


class Run:
    """Writes a run's books the way the coordinator and the learner do (same keys, same fields)."""

    def __init__(self, tmp_path: Path) -> None:
        self.server = fakeredis.FakeServer()
        self.redis = fakeredis.FakeRedis(server=self.server)
        self.root = tmp_path / "checkpoints"
        self.entry: dict[str, bytes] = {}
        self.applied: list[list[object]] = []
        self.redis.xgroup_create(keys.groups(RUN), CONSUMER_GROUP, id="0", mkstream=True)

    def dispatch(self, group_id: str) -> None:
        self.redis.incr(f"{BASE}:cursor")
        self.redis.hset(f"{BASE}:inflight", group_id, "{}")
        self.redis.hincrby(f"{BASE}:counters", "prompts_dispatched", 1)

    def enqueue(self, group_id: str, version: int = 0) -> None:
        group = queue_pb2.ScoredGroup(run_id=RUN, group_id=group_id, policy_version=version)
        group.samples.add(sample_index=0, token_ids=[1], logprobs=[-1.0], policy_version=version)
        group.samples[0].reward.status = common_pb2.REWARD_STATUS_OK
        self.redis.sadd(f"{BASE}:enqueued", group_id)
        self.entry[group_id] = self.redis.xadd(
            keys.groups(RUN), {"data": group.SerializeToString(), "group_id": group_id}
        )
        self.redis.hdel(f"{BASE}:inflight", group_id)
        self.redis.hincrby(f"{BASE}:counters", "groups_queued", 1)

    def drop(self, group_id: str, reason: str) -> None:
        self.redis.xadd(f"{BASE}:dropped", {"group_id": group_id, "prompt_id": "p", "reason": reason})
        self.redis.hdel(f"{BASE}:inflight", group_id)
        self.redis.hincrby(f"{BASE}:counters", f"dropped_{reason}", 1)

    def deliver(self, count: int = 100) -> None:
        self.redis.xreadgroup(CONSUMER_GROUP, "learner-0", {keys.groups(RUN): ">"}, count)

    def ack(self, *group_ids: str) -> None:
        entries = [self.entry[g] for g in group_ids if g in self.entry]
        if entries:
            self.redis.xack(keys.groups(RUN), CONSUMER_GROUP, *entries)

    def train(self, step: int, *group_ids: str, version: int) -> None:
        self.applied += [[step, g] for g in group_ids]
        row = {"step": step, "policy_version": version, "time": 1000.0 + step}
        self.redis.xadd(f"{BASE}:metrics", {"row": json.dumps(row)})
        self.checkpoint(step)
        self.ack(*group_ids)

    def drop_stale(self, group_id: str) -> None:
        self.redis.xadd(f"{BASE}:dropped", {"group_id": group_id, "reason": "stale", "lag": "2"})
        self.ack(group_id)

    def dead_letter(self, group_id: str, reason: str = "max_deliveries") -> None:
        entry = self.entry[group_id]
        self.redis.xadd(
            keys.dead_letters(RUN),
            {"data": b"", "group_id": group_id, "reason": reason, "entry_id": entry, "error": "x"},
        )
        self.redis.xack(keys.groups(RUN), CONSUMER_GROUP, entry)

    def checkpoint(self, step: int, ledger: list[str] | None = None) -> None:
        folder = self.root / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        ids = sorted({str(g) for _, g in self.applied}) if ledger is None else ledger
        extra = {
            "applied_log": {"str": json.dumps(self.applied)},
            "ledger": {"str": json.dumps(ids)},
        }
        (folder / "meta.json").write_text(json.dumps({"step": step, "policy_version": step, "extra": extra}))
        (folder / "COMPLETE").write_text("{}")

    def trim(self) -> int:
        """The production trim (`streams.trim_acknowledged`) on these books."""
        return asyncio.run(trim_acknowledged(fakeredis.FakeAsyncRedis(server=self.server), RUN))

    def violations(self) -> list[str]:
        return reconcile(read_books(self.redis, RUN, self.root)).violations


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """A balanced run: every kind of outcome once."""
    run = Run(tmp_path)
    for g in ["a", "b", "c", "d", "e", "f", "zv", "err", "late"]:
        run.dispatch(g)
    for g in ["a", "b", "c", "d", "e", "f"]:
        run.enqueue(g)
    run.drop("zv", "zero_variance")
    run.drop("err", "scorer_error")
    run.deliver(4)  # a, b, c, d delivered; e, f undelivered
    run.train(1, "a", "b", version=1)
    run.drop_stale("c")
    run.dead_letter("d")
    return run  # "late" still in flight at the coordinator


def test_balanced_books_pass_with_every_outcome_counted(run: Run) -> None:
    ledger = check(run.redis, RUN, run.root)
    assert ledger.violations == []
    assert ledger.count() == {
        TRAINED: 2,
        IN_FLIGHT: 3,  # "late" at the coordinator, e and f undelivered
        "dropped:stale": 1,
        "dropped:zero_variance": 1,
        "dropped:scorer_error": 1,
        "dead_lettered:max_deliveries": 1,
    }
    assert ledger.outcomes["a"] == [TRAINED] and ledger.outcomes["late"] == [IN_FLIGHT]


def test_delivered_but_unacknowledged_is_in_flight(run: Run) -> None:
    run.deliver()  # e, f pending now (a learner died mid-step)
    ledger = check(run.redis, RUN, run.root)
    assert ledger.outcomes["e"] == ledger.outcomes["f"] == [IN_FLIGHT]


def test_poison_entry_dead_lettered_is_fine_but_an_unexplained_one_is_not(run: Run) -> None:
    poison = run.redis.xadd(keys.groups(RUN), {"data": b"\xff\xff not a group"})
    run.deliver()
    record = {"data": b"", "group_id": "", "reason": "decode", "entry_id": poison}
    run.redis.xadd(keys.dead_letters(RUN), record)
    run.redis.xack(keys.groups(RUN), CONSUMER_GROUP, poison)
    assert run.violations() == []
    run.redis.xadd(keys.groups(RUN), {"data": b"junk"})
    run.deliver()
    run.redis.xack(keys.groups(RUN), CONSUMER_GROUP, run.redis.xrange(keys.groups(RUN))[-1][0])
    assert any("never enqueued" in v for v in run.violations())


def test_a_group_trained_twice_fails(run: Run) -> None:
    run.train(2, "a", version=2)
    with pytest.raises(LedgerViolation, match="'a' trained 2 times"):
        check(run.redis, RUN, run.root)


def test_an_acknowledged_group_never_trained_is_lost(run: Run) -> None:
    run.deliver()
    run.ack("e")  # acked without a step, a stale record or a dead letter
    assert any("'e'" in v and "acknowledged but never trained" in v for v in run.violations())


def test_a_prompt_that_vanished_from_the_books_fails(run: Run) -> None:
    run.redis.hdel(f"{BASE}:inflight", "late")  # drawn, counted, then neither enqueued nor dropped
    assert any(v.startswith("prompts_dispatched=9") for v in run.violations())


def test_a_trained_group_that_was_never_enqueued_fails(run: Run) -> None:
    run.train(2, "ghost", version=2)
    assert "group 'ghost' trained but never enqueued" in run.violations()


def test_a_trimmed_entry_fails(run: Run) -> None:
    run.redis.xdel(keys.groups(RUN), run.entry["f"])
    assert any("'f' enqueued but missing from the stream" in v for v in run.violations())


def test_a_group_both_dropped_and_enqueued_fails(run: Run) -> None:
    run.drop("a", "scorer_error")
    assert any("'a' has 2 outcomes" in v for v in run.violations())


def test_a_stale_group_that_was_also_trained_fails(run: Run) -> None:
    run.deliver()
    run.train(2, "e", version=2)
    run.drop_stale("e")
    assert any("'e' has 2 outcomes" in v for v in run.violations())


def test_versions_going_backwards_fail(run: Run) -> None:
    row = {"step": 1, "policy_version": 1, "time": 2000.0}  # another row (its own time) of version 1
    run.redis.xadd(f"{BASE}:metrics", {"row": json.dumps(row)})
    assert any("not increasing" in v for v in run.violations())


def test_a_metrics_row_written_twice_counts_once(run: Run) -> None:
    [(_, fields)] = run.redis.xrevrange(f"{BASE}:metrics", count=1)
    run.redis.xadd(f"{BASE}:metrics", fields)  # a retried XADD: the identical row, time included
    assert run.violations() == []


def test_a_prompt_taken_but_never_recorded_fails(run: Run) -> None:
    run.redis.incr(f"{BASE}:cursor")  # the position moved, no in-flight record, no count: the prompt is lost
    assert "the cursor took 10 prompts but prompts_dispatched=9" in " ".join(run.violations())


def test_a_sample_of_an_unpublished_version_fails(run: Run) -> None:
    run.dispatch("future")
    run.enqueue("future", version=7)
    assert "group 'future' carries unpublished versions [7]" in run.violations()


def test_steps_without_a_checkpoint_fail(run: Run, tmp_path: Path) -> None:
    assert (
        "the learner reported steps but left no complete checkpoint"
        in reconcile(read_books(run.redis, RUN, tmp_path / "nowhere")).violations
    )


def test_an_incomplete_checkpoint_is_ignored(run: Run) -> None:
    run.deliver()
    run.train(2, "e", version=2)
    (run.root / "step-000002" / "COMPLETE").unlink()  # died while writing step 2: step 1 is the lineage
    books = read_books(run.redis, RUN, run.root)
    assert books.checkpoint_step == 1
    found = reconcile(books).violations
    assert any("('e') acknowledged but never trained" in v for v in found), found


def test_a_checkpoint_whose_ledger_disagrees_with_its_log_fails(run: Run) -> None:
    run.checkpoint(1, ledger=["a"])
    assert "the checkpoint's applied-group ledger differs from its applied log" in run.violations()


def test_counters_that_disagree_with_the_records_fail(run: Run) -> None:
    run.redis.hincrby(f"{BASE}:counters", "dropped_zero_variance", 1)
    run.redis.hincrby(f"{BASE}:counters", "groups_queued", 1)
    found = run.violations()
    assert "dropped_zero_variance=2 != 1 records" in found
    assert "groups_queued=7 != 6" in found


def test_a_drop_recorded_twice_is_one_outcome(run: Run) -> None:
    run.redis.xadd(f"{BASE}:dropped", {"group_id": "c", "reason": "stale", "lag": "2"})  # a retried XADD
    ledger = check(run.redis, RUN, run.root)
    assert ledger.outcomes["c"] == ["dropped:stale"]


def test_trimmed_books_still_balance_with_the_same_outcomes(run: Run) -> None:
    before = check(run.redis, RUN, run.root).count()
    assert run.trim() == 4  # a, b (trained), c (stale), d (dead-lettered): all acknowledged
    assert run.redis.xlen(keys.groups(RUN)) == 2  # e, f undelivered: kept
    assert check(run.redis, RUN, run.root).count() == before


def test_a_trimmed_entry_never_trained_is_still_lost(run: Run) -> None:
    run.deliver()
    run.ack("e")  # acknowledged, never trained nor dropped
    run.trim()
    assert any("('e') acknowledged but never trained" in v for v in run.violations())


def test_a_trimmed_entry_of_an_unpublished_version_still_fails(run: Run) -> None:
    run.dispatch("g")
    run.enqueue("g", version=7)
    run.deliver()
    run.train(2, "e", "f", "g", version=2)
    run.trim()
    assert run.redis.xlen(keys.groups(RUN)) == 0
    assert "group 'g' carries unpublished versions [7]" in run.violations()


# --- a learner restart that rolled versions back (rlfabric.contracts.lineage) ----------------------------


def restore(run: Run, version: int, step: int, weights_of: int, rolled_back: list[int]) -> None:
    """What a resumed learner records: the restore, then its marker row."""
    record = RestoreRecord(version, step, weights_of, rolled_back, 1.0)
    run.redis.hset(keys.lineage(RUN), str(version), record.to_json())
    run.redis.xadd(f"{BASE}:metrics", {"row": json.dumps(restart_row(step, version))})


def hand_back(run: Run, group_id: str, version: int) -> str:
    """What `lineage.HAND_BACK` writes (fakeredis has no Lua): record, new id in flight, counter, ack."""
    new_id = redispatch_id(group_id)
    record = {"group_id": group_id, "redispatched_as": new_id, "prompt_id": "p", "version": str(version)}
    run.redis.xadd(keys.rolled_back(RUN), record)
    run.redis.hset(f"{BASE}:inflight", new_id, "{}")
    run.redis.hincrby(f"{BASE}:counters", keys.Counter.ROLLED_BACK, 1)
    run.ack(group_id)
    return new_id


@pytest.fixture
def restarted(run: Run) -> Run:
    """The balanced run, then: step 2 trained on version 1 and published as version 2, never checkpointed;
    group "h" generated by version 2; the learner dies, resumes from step 1 as version 3 (rolling 2 back)
    and hands "h" back as "h:r1"."""
    run.redis.xadd(f"{BASE}:metrics", {"row": json.dumps({"step": 2, "policy_version": 2, "time": 1002.0})})
    run.dispatch("h")
    run.enqueue("h", version=2)
    run.deliver()
    restore(run, version=3, step=1, weights_of=1, rolled_back=[2])
    hand_back(run, "h", 2)
    return run


def test_a_group_of_a_rolled_back_version_handed_back_balances(restarted: Run) -> None:
    ledger = check(restarted.redis, RUN, restarted.root)
    assert ledger.outcomes["h"] == [ROLLED_BACK] and ledger.outcomes["h:r1"] == [IN_FLIGHT]
    restarted.enqueue("h:r1", version=3)  # generated again by the restored policy, then trained once
    restarted.deliver()
    restarted.train(2, "h:r1", version=4)
    ledger = check(restarted.redis, RUN, restarted.root)
    assert ledger.outcomes["h"] == [ROLLED_BACK] and ledger.outcomes["h:r1"] == [TRAINED]
    assert ledger.count()[ROLLED_BACK] == 1


def test_a_rolled_back_version_without_a_step_row_counts_as_published(run: Run) -> None:
    """The learner published version 2 and died before writing its step row; the store later pruned it.
    The restore that rolled it back is the record that it was published (seen in a whole-loop test)."""
    run.dispatch("h")
    run.enqueue("h", version=2)
    run.deliver()
    assert "group 'h' carries unpublished versions [2]" in run.violations()
    restore(run, version=3, step=1, weights_of=1, rolled_back=[2])
    hand_back(run, "h", 2)
    assert not any("unpublished" in v for v in run.violations())


def test_a_handed_back_group_whose_new_id_vanished_is_lost(restarted: Run) -> None:
    restarted.redis.hdel(f"{BASE}:inflight", "h:r1")
    assert any("handed back as 'h:r1', which has no outcome" in v for v in restarted.violations())


def test_handing_back_a_group_of_a_version_not_rolled_back_fails(restarted: Run) -> None:
    hand_back(restarted, "e", 0)  # version 0 is in the restored lineage: it should have been trained
    assert any("'e' handed back, but its version 0 was not rolled back" in v for v in restarted.violations())


def test_training_samples_of_a_rolled_back_version_fails(run: Run) -> None:
    run.dispatch("h")
    run.enqueue("h", version=2)
    run.deliver()
    run.redis.xadd(f"{BASE}:metrics", {"row": json.dumps({"step": 2, "policy_version": 2, "time": 1002.0})})
    restore(run, version=3, step=1, weights_of=1, rolled_back=[2])
    run.train(2, "h", version=4)
    assert any("'h' trained on samples of rolled-back versions [2]" in v for v in run.violations())


def test_a_rolled_back_counter_off_by_one_fails(restarted: Run) -> None:
    restarted.redis.hincrby(f"{BASE}:counters", keys.Counter.ROLLED_BACK, 1)
    assert "rolled_back=2 != 1 records" in restarted.violations()


def test_a_restart_marker_is_not_a_step_of_its_own(run: Run) -> None:
    # a learner that resumes where the newest version already holds its checkpoint publishes nothing:
    # its marker names the version of the step before, which must not read as versions going backwards
    run.redis.xadd(f"{BASE}:metrics", {"row": json.dumps(restart_row(1, 1))})
    assert run.violations() == []
    assert read_books(run.redis, RUN, run.root).metric_versions == [1]
