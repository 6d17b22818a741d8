"""The fleet scheduler's rules (`coordinator.fleet.FairShare`, no I/O) and its slot hand-off between lanes:
weighted fair share between runs that always wait (group by group and in bursts), no starvation of a tiny
weight, bursts that keep a run's step together, adapter eligibility, the replica's capacity and each run's
per-replica bound, failed and departed replicas."""

from __future__ import annotations

import asyncio
import random

import pytest

from rlfabric.coordinator.config import ScalingConfig
from rlfabric.coordinator.fleet import FairShare, FleetScheduler, SlotRequest
from rlfabric.coordinator.replicas import REPLICA_BACKOFF_S
from rlfabric.coordinator.scaling import BusyMeter

NOW = 100.0


def share_with(
    replicas: dict[str, tuple[int, set[str]]], runs: dict[str, tuple[float, int]], burst: int = 1
) -> FairShare:
    rules = FairShare()
    rules.set_replicas({a: (cap, dict.fromkeys(ads, 0)) for a, (cap, ads) in replicas.items()})
    for run_id, (weight, per_replica) in runs.items():
        rules.add_run(run_id, weight, per_replica, burst)
    return rules


def simulate(rules: FairShare, steps: int, seed: int = 0) -> dict[str, int]:
    """Every run always has one request waiting; each step one group in flight (chosen at random) ends and
    every grant possible is made. Returns the grants per run after the warm-up (the first slots)."""
    rng = random.Random(seed)
    in_flight: list[tuple[str, str]] = []
    counted = {run_id: 0 for run_id in rules.runs}
    for step in range(steps):
        for run_id in rules.runs:
            if not any(r.run_id == run_id for r in rules.waiting):
                rules.request(run_id, "")
        for request, address in rules.grants(NOW):
            in_flight.append((request.run_id, address))
            if step > 0:
                counted[request.run_id] += 1
        run_id, address = in_flight.pop(rng.randrange(len(in_flight)))
        rules.give_back(run_id, address, NOW)
    return counted


def test_runs_that_always_wait_get_slots_in_proportion_to_their_weights() -> None:
    rules = share_with({"r1": (8, set()), "r2": (8, set())}, {"light": (1.0, 8), "heavy": (3.0, 8)})
    grants = simulate(rules, steps=20_000)
    ratio = grants["heavy"] / grants["light"]
    assert abs(ratio - 3.0) / 3.0 < 0.05, grants
    assert sum(grants.values()) >= 19_900  # about one grant per ended group: the slots stay in use


@pytest.mark.parametrize("burst", [4, 8])
def test_bursts_keep_the_weights(burst: int) -> None:
    rules = share_with({"r1": (8, set()), "r2": (8, set())}, {"light": (1.0, 8), "heavy": (3.0, 8)}, burst)
    grants = simulate(rules, steps=20_000)
    ratio = grants["heavy"] / grants["light"]
    assert abs(ratio - 3.0) / 3.0 < 0.05, grants


def test_equal_weights_get_equal_slots() -> None:
    rules = share_with({"r1": (4, set())}, {"a": (1.0, 4), "b": (1.0, 4), "c": (1.0, 4)})
    grants = simulate(rules, steps=9_000, seed=1)
    assert max(grants.values()) / min(grants.values()) < 1.05, grants


def test_a_tiny_weight_gets_the_next_free_slot_no_starvation() -> None:
    rules = share_with({"r1": (4, set())}, {"big": (1.0, 4), "tiny": (0.01, 4)})
    held = []
    for _ in range(4):
        rules.request("big", "")
        held += rules.grants(NOW)
    assert [a for _, a in held] == ["r1"] * 4
    tiny = rules.request("tiny", "")
    more_big = [rules.request("big", "") for _ in range(10)]
    assert rules.grants(NOW) == []  # full: everyone waits
    request, address = held.pop(0)
    rules.give_back(request.run_id, address, NOW)
    assert rules.grants(NOW) == [(tiny, "r1")]  # the next slot that frees, ahead of 10 earlier-queued ones
    assert all(r in rules.waiting for r in more_big)


def test_a_run_keeps_the_turn_for_its_burst_so_its_step_generates_first() -> None:
    """Four runs ask for their steps' 4 groups at once, interleaved; 8 slots: the first two runs' steps
    take them whole, and each slot that frees goes to the third run's step, then the fourth's."""
    rules = share_with({"r1": (8, set())}, {run: (1.0, 8) for run in "abcd"}, burst=4)
    for _ in range(4):
        for run in "abcd":
            rules.request(run, "")
    assert [r.run_id for r, _ in rules.grants(NOW)] == list("aaaabbbb")
    freed = []
    for run in "aaaabbbb":
        rules.give_back(run, "r1", NOW)
        freed += [r.run_id for r, _ in rules.grants(NOW)]
    assert freed == list("ccccdddd")


def test_a_burst_ends_when_its_run_has_nothing_waiting() -> None:
    rules = share_with({"r1": (8, set())}, {"a": (1.0, 8), "b": (1.0, 8)}, burst=4)
    rules.request("a", "")
    rules.request("b", "")
    assert [r.run_id for r, _ in rules.grants(NOW)] == ["a", "b"]  # a's turn had nothing more waiting
    rules.request("a", "")
    rules.request("b", "")
    assert [r.run_id for r, _ in rules.grants(NOW)] == ["b", "a"]  # b's turn goes on


def test_a_lighter_run_takes_its_share_of_the_burst() -> None:
    rules = share_with({"r1": (16, set())}, {"light": (1.0, 16), "heavy": (4.0, 16)}, burst=8)
    assert (rules.burst_of("light"), rules.burst_of("heavy")) == (2, 8)
    for _ in range(8):
        rules.request("light", "")
    assert [r.run_id for r, _ in rules.grants(NOW)].count("light") == 8  # no one else waits: all granted
    assert rules.turn == "light"
    rules.remove_run("light")
    assert rules.turn is None and rules.burst_of("heavy") == 8


def test_a_tiny_weight_waits_for_at_most_one_burst() -> None:
    rules = share_with({"r1": (4, set())}, {"big": (1.0, 4), "tiny": (0.01, 4)}, burst=3)
    for _ in range(4):
        rules.request("big", "")
    held = rules.grants(NOW)
    tiny = rules.request("tiny", "")
    for _ in range(10):
        rules.request("big", "")
    granted = []
    for request, address in held:
        rules.give_back(request.run_id, address, NOW)
        granted += [r for r, _ in rules.grants(NOW)]
    assert granted.index(tiny) <= rules.burst_of("big")  # behind what is left of big's burst at most


def test_ties_go_to_the_earliest_request() -> None:
    rules = share_with({"r1": (1, set())}, {"a": (1.0, 1), "b": (1.0, 1)})
    first, _ = rules.request("b", ""), rules.request("a", "")
    assert rules.grants(NOW) == [(first, "r1")]


def test_a_request_on_an_adapter_goes_only_to_replicas_that_hold_it() -> None:
    rules = share_with(
        {"r1": (2, {"run-a"}), "r2": (2, {"run-b"}), "r3": (2, set())},
        {"a": (1.0, 4), "b": (1.0, 4)},
    )
    on_a = [rules.request("a", "run-a") for _ in range(3)]
    granted = rules.grants(NOW)
    assert [(r, addr) for r, addr in granted] == [(on_a[0], "r1"), (on_a[1], "r1")]
    assert rules.waiting == [on_a[2]]  # r2 and r3 are free but do not serve run-a
    base = rules.request("a", "")
    assert rules.grants(NOW) == [(base, "r2")]  # the base anywhere (least loaded, then by name)
    unknown = rules.request("b", "run-c")
    assert rules.grants(NOW) == []
    assert unknown in rules.waiting


def test_a_request_waits_here_until_a_replica_serves_its_version() -> None:
    """Not in a slot of the replica while the new version loads: another run's group takes the slot."""
    rules = share_with({"r1": (1, set())}, {"a": (1.0, 4), "b": (1.0, 4)})
    rules.set_replicas({"r1": (1, {"run-a": 3, "run-b": 7})})
    newer = rules.request("a", "run-a", version=4)
    ready = rules.request("b", "run-b", version=7)
    assert rules.grants(NOW) == [(ready, "r1")]
    rules.give_back("b", "r1", NOW)
    assert rules.grants(NOW) == []  # r1 free, but still serving run-a's version 3
    rules.set_replicas({"r1": (1, {"run-a": 5, "run-b": 7})})  # loaded meanwhile (a newer one serves too)
    assert rules.grants(NOW) == [(newer, "r1")]


def test_a_run_that_cannot_be_placed_does_not_hold_up_another() -> None:
    rules = share_with({"r1": (4, {"run-b"})}, {"a": (1.0, 4), "b": (1.0, 4)})
    blocked = rules.request("a", "run-a")  # first in line (share 0, earliest) but no replica holds run-a
    placed = rules.request("b", "run-b")
    assert rules.grants(NOW) == [(placed, "r1")]
    assert rules.waiting == [blocked]


def test_capacity_bounds_the_replica_and_per_replica_bounds_each_run() -> None:
    rules = share_with({"r1": (3, set())}, {"a": (1.0, 2), "b": (1.0, 5)})
    on_a = [rules.request("a", "") for _ in range(3)]
    assert [r for r, _ in rules.grants(NOW)] == on_a[:2]  # a's bound: 2 on one replica
    on_b = [rules.request("b", "") for _ in range(3)]
    assert [r for r, _ in rules.grants(NOW)] == on_b[:1]  # the replica's capacity: 3 in all
    assert rules.replicas["r1"].runs == {"a": 2, "b": 1}
    rules.set_replicas({"r1": (3, {}), "r2": (3, {})})
    granted = rules.grants(NOW)
    assert [(r.run_id, a) for r, a in granted] == [("b", "r2"), ("a", "r2"), ("b", "r2")]
    assert rules.run_load("a") == {"r1": 2, "r2": 1} and rules.run_load("b") == {"r1": 1, "r2": 2}


def test_a_failed_replica_gets_nothing_new_for_the_backoff() -> None:
    rules = share_with({"r1": (4, set()), "r2": (4, set())}, {"a": (1.0, 4)})
    first = rules.request("a", "")
    [(_, address)] = rules.grants(NOW)
    rules.give_back("a", address, NOW, failed=True)
    assert first not in rules.waiting
    again = [rules.request("a", "") for _ in range(2)]
    other = "r2" if address == "r1" else "r1"
    assert [a for _, a in rules.grants(NOW)] == [other, other]
    for r, a in [(again[0], other), (again[1], other)]:
        rules.give_back(r.run_id, a, NOW)
    later = rules.request("a", "")
    later_2 = rules.request("a", "")
    assert {a for _, a in rules.grants(NOW + REPLICA_BACKOFF_S + 0.1)} == {"r1", "r2"}
    assert later not in rules.waiting and later_2 not in rules.waiting


def test_a_replica_that_leaves_gets_nothing_new_and_is_forgotten_when_its_groups_end() -> None:
    rules = share_with({"r1": (4, set()), "r2": (4, set())}, {"a": (1.0, 4)})
    for _ in range(2):
        rules.request("a", "")
    assert sorted(a for _, a in rules.grants(NOW)) == ["r1", "r2"]
    new, gone = rules.set_replicas({"r2": (4, {})})  # r1 left the registry (draining)
    assert (new, gone) == (set(), set())  # kept while its group runs
    rules.request("a", "")
    rules.request("a", "")
    assert [a for _, a in rules.grants(NOW)] == ["r2", "r2"]
    rules.give_back("a", "r1", NOW)
    assert rules.set_replicas({"r2": (4, {})}) == (set(), {"r1"})
    assert "r1" not in rules.replicas


def test_a_run_that_leaves_takes_its_waiting_requests_along() -> None:
    rules = share_with({"r1": (1, set())}, {"a": (1.0, 1), "b": (1.0, 1)})
    rules.request("a", "")
    rules.grants(NOW)
    waiting = [rules.request("b", ""), rules.request("a", "")]
    assert rules.remove_run("b") == [waiting[0]]
    assert rules.waiting == [waiting[1]]
    with pytest.raises(KeyError):
        rules.request("b", "")


def test_slots_per_replica_of_the_fleet_signal() -> None:
    rules = share_with({}, {"a": (1.0, 2), "b": (1.0, 3)})
    assert rules.slots_per_replica() == 5  # no replica seen: the runs' bounds together
    rules.set_replicas({"r1": (4, {}), "r2": (8, {})})
    assert rules.slots_per_replica() == 4  # the smallest capacity
    assert isinstance(SlotRequest("a", "", 0), SlotRequest)


# --- the scheduler's hand-off between lanes (no registry: replicas set directly) -------------------------


def scheduler_with(capacity: int) -> FleetScheduler:
    scheduler = FleetScheduler(redis=None, fleet="shared")
    scheduler.rules.set_replicas({"127.0.0.1:1": (capacity, {"lora-a": 0})})
    return scheduler


async def test_a_released_slot_wakes_the_waiting_run_with_the_smaller_share() -> None:
    scheduler = scheduler_with(capacity=2)
    a = scheduler.lane("a", 1.0, 2, admit_bound=4, meter=BusyMeter(30.0))
    b = scheduler.lane("b", 1.0, 2, admit_bound=4, meter=BusyMeter(30.0))
    first = await a.acquire("lora-a")
    await a.acquire("")
    waiting_a = asyncio.create_task(a.acquire(""))
    await asyncio.sleep(0)
    waiting_b = asyncio.create_task(b.acquire(""))
    await asyncio.sleep(0.01)
    assert (a.waiting, b.waiting) == (1, 1)
    await a.release(first)
    assert await asyncio.wait_for(waiting_b, 1.0) == first  # b: 0 in flight, a: 1
    assert not waiting_a.done()
    assert b.load == {first: 1} and a.load == {first: 1}
    assert scheduler.meter.replicas[first].busy_since is not None
    waiting_a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting_a
    assert a.waiting == 0 and scheduler.rules.waiting == []


async def test_a_cancelled_request_granted_meanwhile_hands_its_slot_back() -> None:
    scheduler = scheduler_with(capacity=1)
    a = scheduler.lane("a", 1.0, 1, admit_bound=4, meter=BusyMeter(30.0))
    held = await a.acquire("")
    late = asyncio.create_task(a.acquire(""))
    await asyncio.sleep(0.01)
    await a.release(held)  # grants `late` its slot ...
    late.cancel()  # ... and it is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await late
    assert a.load == {} and scheduler.rules.replicas[held].load == 0


async def test_closing_a_lane_drops_its_waiting_requests() -> None:
    scheduler = scheduler_with(capacity=1)
    a = scheduler.lane("a", 1.0, 1, admit_bound=4, meter=BusyMeter(30.0))
    scheduler.lane("b", 1.0, 1, admit_bound=4, meter=BusyMeter(30.0))
    await a.acquire("")
    blocked = asyncio.create_task(a.acquire(""))
    await asyncio.sleep(0.01)
    await a.close()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(blocked, 1.0)
    assert "a" not in scheduler.rules.runs and scheduler.rules.waiting == []


async def test_the_fleet_signal_sums_the_demand_of_its_runs() -> None:
    scheduler = scheduler_with(capacity=2)
    scheduler.meter.seen("127.0.0.1:1", 0.0)
    a = scheduler.lane("a", 1.0, 2, admit_bound=8, meter=BusyMeter(30.0))
    b = scheduler.lane("b", 1.0, 2, admit_bound=4, meter=BusyMeter(30.0))
    await a.acquire("")
    await b.acquire("")
    waiting = [asyncio.create_task(lane.acquire("")) for lane in (a, a, b)]
    await asyncio.sleep(0.01)
    signal = scheduler.signal()
    assert (signal.replicas, signal.in_flight_groups, signal.backlog_groups) == (1, 2, 3)
    assert signal.desired_replicas == 3  # 5 groups of demand, 2 a replica; at most 8 + 4 admitted
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert scheduler.signal().backlog_groups == 0


async def test_the_registry_loop_runs_while_a_lane_watches_and_restarts_for_a_later_one() -> None:
    scheduler = FleetScheduler(redis=None, fleet="shared", scaling=ScalingConfig(interval_s=0.01))
    refreshes: list[float] = []

    async def refresh() -> None:
        refreshes.append(0.0)

    async def export_signal() -> None:
        pass

    scheduler.refresh = refresh  # type: ignore[method-assign]
    scheduler.export_signal = export_signal  # type: ignore[assignment, method-assign]
    first = scheduler.lane("a", 1.0, 1, admit_bound=4, meter=BusyMeter(30.0))
    watching = asyncio.create_task(first.watch())
    await asyncio.sleep(0.05)
    assert refreshes
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    second = scheduler.lane("b", 1.0, 1, admit_bound=4, meter=BusyMeter(30.0))  # before a's lane closed
    watching = asyncio.create_task(second.watch())
    await asyncio.sleep(0)
    await first.close()  # b is still on the fleet: its loop goes on
    before = len(refreshes)
    await asyncio.sleep(0.05)
    assert len(refreshes) > before
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    await second.close()
    stopped = len(refreshes)
    await asyncio.sleep(0.05)
    assert len(refreshes) == stopped
