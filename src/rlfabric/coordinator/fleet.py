"""The coordinator's scheduler of a shared rollout fleet: the replica slots of one fleet, granted to the
runs generating on it by weighted fair share.

One `FleetScheduler` per fleet name per coordinator serves every run whose spec names that fleet
(`rollout.fleet`). It discovers the fleet's replicas in the registry (`keys.fleet_scope(fleet)`, only
those taking work) and grants a free slot, when several runs wait, to the waiting run with the fewest groups
in flight on the fleet per unit of its `rollout.fleet_weight` (ties: the earliest request). So runs that
always wait get slots in proportion to their weights, and a run with a tiny weight still gets the next
slot that frees once its share is the smallest (it never starves).

Slots go in bursts: the run served keeps the turn for up to its `burst` grants in a row (a step's groups,
`train.groups_per_step`, scaled by its weight against the heaviest run's) while it has requests waiting,
before the share picks the next run. Interleaved group by group, runs that wait on their own steps
(on-policy above all) finish every step's generation together and then all train at once while the
replicas idle; in bursts, one run's step finishes first and it trains while the next run's step
generates, so generation and training overlap across runs. The share still decides whose burst comes
next, so a burst delays another run by at most one step's groups. This pays only when the replicas'
`capacity` (their `max_in_flight`) holds a run's step or two, not every run's at once: beyond the
capacity requests wait here, in this order, rather than in the engine.

A request on a run's adapter goes only to replicas whose entry lists that adapter at the version the
request needs (the learner's announced one) or newer; a request on the base ("" adapter, version 0) goes
anywhere. So a slot is not held by a request that would only wait inside the replica while the new version
loads (other runs' groups generate in it meanwhile); the registry is read every `REFRESH_S` (and the
replica beats its heartbeat as soon as an adapter version loads).

On one replica the groups in flight stay within its entry's `capacity` and each run's within its own
`rollout.max_in_flight_per_replica`; a replica whose generation failed gets nothing new for
`REPLICA_BACKOFF_S`. The rules are `FairShare`, which does no I/O; the scheduler feeds it.

Each run's pipeline sees the scheduler through its `FleetLane`, which has the interface of a run's own
`ReplicaPool`. The scheduler's busy meter covers the fleet's replicas; its signal sums the runs' demand
(groups in flight, groups waiting, the lag bounds) into `keys.fleet_scaling(fleet)` and the
`rlfabric_coordinator_fleet_*` gauges every `scaling.interval_s`, while each run still writes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from rlfabric.contracts import keys, registry
from rlfabric.coordinator.config import ScalingConfig
from rlfabric.coordinator.replicas import REPLICA_BACKOFF_S
from rlfabric.coordinator.scaling import (
    BusyMeter,
    ScalingSignal,
    clear_fleet_gauges,
    export_fleet_gauges,
    scaling_signal,
)
from rlfabric.runtime.aio import cancel_point
from rlfabric.runtime.grpc_client import make_channel
from rlfabric.v1 import rollout_pb2_grpc

log = logging.getLogger(__name__)

BASE_ADAPTER = ""
"""The adapter name of a request on the base model (version 0): any replica of the fleet serves it."""
REFRESH_S = 0.1
"""How often the scheduler reads the fleet's replicas from the registry (a new adapter version a request
waits for is seen within this)."""
WAIT_TICK_S = 1.0
"""How often a waiting request looks again without news (a replica's backoff may have ended)."""


# --- the rules (no I/O) ------------------------------------------------------------------------------------


@dataclass
class ReplicaSlots:
    """One replica of the fleet as the rules see it."""

    capacity: int
    """Groups it holds at once (its registry entry's `capacity`)."""
    adapters: Mapping[str, int]
    """The adapters it serves and the version of each (its entry's `adapters`)."""
    live: bool = True
    """Listed in the registry as taking work (one that left stays here, not live, until its groups end)."""
    excluded_until: float = 0.0
    """Monotonic time before which it gets nothing new (its generation failed)."""
    runs: dict[str, int] = field(default_factory=dict)
    """Groups in flight on it, by run."""

    @property
    def load(self) -> int:
        return sum(self.runs.values())


@dataclass
class RunShare:
    """One run of the fleet as the rules see it."""

    weight: float
    """Its `rollout.fleet_weight`."""
    per_replica: int
    """Its `rollout.max_in_flight_per_replica`."""
    burst: int = 1
    """Grants it may take in a row while it waits (its `train.groups_per_step`; 1: group by group)."""
    in_flight: int = 0
    """Its groups in flight on the fleet."""

    @property
    def share(self) -> float:
        """Groups in flight per unit of weight: the waiting run with the smallest is served first."""
        return self.in_flight / self.weight


@dataclass(frozen=True)
class SlotRequest:
    """A group of `run_id` waiting for a slot to generate on `adapter`; `arrival` orders ties."""

    run_id: str
    adapter: str
    arrival: int
    version: int = 0
    """The adapter version it needs (the replica's serving one or newer)."""


class FairShare:
    """Weighted fair share of a fleet's replica slots: the state (replicas, runs, waiting requests) and the
    rules that grant slots. Time is passed in (`now`, monotonic seconds), so the rules are testable as is."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaSlots] = {}
        self.runs: dict[str, RunShare] = {}
        self.waiting: list[SlotRequest] = []
        self._arrivals = itertools.count()
        self.turn: str | None = None
        """The run whose burst is being granted."""
        self.turn_left = 0
        """Grants left in its burst."""

    # --- membership -------------------------------------------------------------------------------

    def add_run(self, run_id: str, weight: float, per_replica: int, burst: int = 1) -> None:
        in_flight = self.runs[run_id].in_flight if run_id in self.runs else 0
        self.runs[run_id] = RunShare(weight, per_replica, max(1, burst), in_flight)

    def remove_run(self, run_id: str) -> list[SlotRequest]:
        """Forgets the run; returns its waiting requests (taken off the queue)."""
        self.runs.pop(run_id, None)
        if self.turn == run_id:
            self.turn, self.turn_left = None, 0
        dropped = [r for r in self.waiting if r.run_id == run_id]
        self.waiting = [r for r in self.waiting if r.run_id != run_id]
        return dropped

    def set_replicas(self, live: Mapping[str, tuple[int, Mapping[str, int]]]) -> tuple[set[str], set[str]]:
        """The replicas the registry lists as taking work now: address -> (capacity, adapter versions). One
        that left is kept (not live) while groups run on it. Returns (addresses new, addresses forgotten)."""
        new = live.keys() - self.replicas.keys()
        for address, (capacity, adapters) in live.items():
            slots = self.replicas.setdefault(address, ReplicaSlots(capacity, adapters))
            slots.capacity, slots.adapters, slots.live = capacity, adapters, True
        gone = set()
        for address in self.replicas.keys() - live.keys():
            self.replicas[address].live = False
            if self.replicas[address].load == 0:
                del self.replicas[address]
                gone.add(address)
        return set(new), gone

    # --- requests ---------------------------------------------------------------------------------

    def request(self, run_id: str, adapter: str, version: int = 0) -> SlotRequest:
        """Queues a request of `run_id` (a member) for a slot serving `adapter` at `version` or newer."""
        if run_id not in self.runs:
            raise KeyError(f"run {run_id!r} is not on the fleet")
        request = SlotRequest(run_id, adapter, next(self._arrivals), version)
        self.waiting.append(request)
        return request

    def withdraw(self, request: SlotRequest) -> bool:
        """Takes a waiting request off the queue; False when it is not waiting (granted or dropped)."""
        if request in self.waiting:
            self.waiting.remove(request)
            return True
        return False

    def eligible(self, request: SlotRequest, now: float) -> str | None:
        """The least-loaded replica that may take `request` now, or None."""
        run = self.runs[request.run_id]
        ready = [
            address
            for address, r in self.replicas.items()
            if r.live
            and r.excluded_until <= now
            and r.load < r.capacity
            and r.runs.get(request.run_id, 0) < run.per_replica
            and (request.adapter == BASE_ADAPTER or r.adapters.get(request.adapter, -1) >= request.version)
        ]
        return min(ready, key=lambda a: (self.replicas[a].load, a)) if ready else None

    def next_grant(self, now: float) -> tuple[SlotRequest, str] | None:
        """The waiting request served next and its replica: the run whose burst is being granted while it
        has grants left and a request some replica may take; otherwise waiting runs by (in flight /
        weight, arrival), the first whose request some replica may take."""
        if self.turn_left > 0:
            for request in self.waiting:
                if request.run_id == self.turn and (address := self.eligible(request, now)) is not None:
                    return request, address
        for request in sorted(self.waiting, key=lambda r: (self.runs[r.run_id].share, r.arrival)):
            address = self.eligible(request, now)
            if address is not None:
                return request, address
        return None

    def take(self, request: SlotRequest, address: str) -> None:
        """Grants `request` a slot on `address`."""
        self.waiting.remove(request)
        replica = self.replicas[address]
        replica.runs[request.run_id] = replica.runs.get(request.run_id, 0) + 1
        run = self.runs.get(request.run_id)
        if run is not None:
            run.in_flight += 1
        if request.run_id == self.turn and self.turn_left > 0:
            self.turn_left -= 1
        else:
            self.turn, self.turn_left = request.run_id, self.burst_of(request.run_id) - 1

    def burst_of(self, run_id: str) -> int:
        """Grants in a row a turn of `run_id` may take: its burst in proportion to its weight against the
        heaviest run's (so bursts keep the weights: a run of weight 1 beside one of 3 takes a third of its
        burst a turn, at least 1)."""
        run = self.runs.get(run_id)
        if run is None:
            return 1
        heaviest = max(r.weight for r in self.runs.values())
        return max(1, math.ceil(run.burst * run.weight / heaviest))

    def grants(self, now: float) -> list[tuple[SlotRequest, str]]:
        """Every grant possible now, in order (each one taken)."""
        granted = []
        while (grant := self.next_grant(now)) is not None:
            self.take(*grant)
            granted.append(grant)
        return granted

    def give_back(self, run_id: str, address: str, now: float, *, failed: bool = False) -> None:
        """A group of `run_id` on `address` ended; a failed replica gets nothing new for a while."""
        replica = self.replicas.get(address)
        if replica is not None and replica.runs.get(run_id, 0) > 0:
            replica.runs[run_id] -= 1
            if replica.runs[run_id] == 0:
                del replica.runs[run_id]
            if run_id in self.runs:
                self.runs[run_id].in_flight = max(0, self.runs[run_id].in_flight - 1)
        if replica is not None and failed:
            replica.excluded_until = now + REPLICA_BACKOFF_S

    def run_load(self, run_id: str) -> dict[str, int]:
        """The run's groups in flight per replica."""
        return {a: r.runs[run_id] for a, r in self.replicas.items() if run_id in r.runs}

    def slots_per_replica(self) -> int:
        """Groups one replica holds for the fleet's runs together: the smallest live replica's capacity,
        at most the sum of the runs' per-replica bounds (that sum alone before any replica is seen)."""
        by_runs = sum(run.per_replica for run in self.runs.values())
        capacities = [r.capacity for r in self.replicas.values() if r.live]
        return max(1, min([*capacities, by_runs]) if by_runs else min(capacities, default=1))


# --- the scheduler (I/O) -----------------------------------------------------------------------------------


class FleetScheduler:
    """One fleet's replica slots for the coordinator's runs on it; `lane` gives a run's pipeline its view.
    The registry refresh and the fleet's signal run while any lane watches (`FleetLane.watch`)."""

    def __init__(
        self, redis: Any, fleet: str, scaling: ScalingConfig | None = None, *, token: str | None = None
    ) -> None:
        self.redis, self.fleet, self.token = redis, fleet, token
        self.scope = keys.fleet_scope(fleet)
        self.scaling = scaling or ScalingConfig()
        self.rules = FairShare()
        self.meter = BusyMeter(self.scaling.window_s)
        """Busy intervals of the fleet's replicas (any run's groups)."""
        self.lanes: dict[str, FleetLane] = {}
        self.granted: dict[SlotRequest, asyncio.Future[str]] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.watchers = 0
        self._task: asyncio.Task[None] | None = None
        self._ending: set[asyncio.Task[None]] = set()

    def lane(
        self,
        run_id: str,
        weight: float,
        per_replica: int,
        admit_bound: int,
        meter: BusyMeter,
        burst: int = 1,
    ) -> FleetLane:
        """Adds the run to the fleet's share; its pipeline's view (`meter`: the run's own busy meter;
        `burst`: the grants it may take in a row, its step's groups)."""
        self.rules.add_run(run_id, weight, per_replica, burst)
        lane = FleetLane(self, run_id, admit_bound, meter)
        self.lanes[run_id] = lane
        now = time.monotonic()
        for address, replica in self.rules.replicas.items():
            if replica.live:
                meter.seen(address, now)
        return lane

    # --- slots ------------------------------------------------------------------------------------

    async def acquire(self, run_id: str, adapter: str, version: int = 0) -> str:
        """A replica slot for a group of `run_id` on `adapter` at `version` or newer, waiting for the run's
        fair turn."""
        request = self.rules.request(run_id, adapter, version)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.granted[request] = future
        self.dispatch()
        try:
            while True:
                cancel_point()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WAIT_TICK_S):
                        return await asyncio.shield(future)
                self.dispatch()
        except BaseException:
            self._abandon(request, future)
            raise
        finally:
            self.granted.pop(request, None)

    def _abandon(self, request: SlotRequest, future: asyncio.Future[str]) -> None:
        """A cancelled acquire: off the queue, or its slot handed back when it was granted meanwhile."""
        if not self.rules.withdraw(request) and future.done() and not future.cancelled():
            self._give_back(request.run_id, future.result(), failed=False)
            self.dispatch()

    def dispatch(self) -> None:
        """Grants every slot the rules allow now and wakes the requests served."""
        now = time.monotonic()
        for request, address in self.rules.grants(now):
            self._loads_changed(request.run_id, address, now)
            future = self.granted.get(request)
            if future is not None and not future.done():
                future.set_result(address)

    async def release(self, run_id: str, address: str, *, failed: bool = False) -> None:
        self._give_back(run_id, address, failed=failed)
        self.dispatch()

    def _give_back(self, run_id: str, address: str, *, failed: bool) -> None:
        now = time.monotonic()
        self.rules.give_back(run_id, address, now, failed=failed)
        self._loads_changed(run_id, address, now)

    def _loads_changed(self, run_id: str, address: str, now: float) -> None:
        replica = self.rules.replicas.get(address)
        self.meter.update(address, replica.load if replica else 0, now)
        lane = self.lanes.get(run_id)
        if lane is not None:
            lane.meter.update(address, replica.runs.get(run_id, 0) if replica else 0, now)

    def stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self.channels:
            self.channels[address] = make_channel(address, bearer_token=self.token)
        return rollout_pb2_grpc.RolloutServiceStub(self.channels[address])

    # --- the registry and the signal --------------------------------------------------------------

    async def refresh(self) -> None:
        """The fleet's replicas taking work, from the registry; waiting requests served if they now can."""
        entries = await registry.discover(self.redis, self.scope)
        live = {e.address: (e.capacity, e.adapter_versions()) for e in entries if e.takes_work}
        new, gone = self.rules.set_replicas(live)
        now = time.monotonic()
        for meter in [self.meter, *(lane.meter for lane in self.lanes.values())]:
            for address in new:
                meter.seen(address, now)
            for address in gone:
                meter.gone(address, now)
        self.dispatch()

    def signal(self) -> ScalingSignal:
        """The fleet's autoscaling signal: its replicas' busy meter and the sum of its runs' demand."""
        return scaling_signal(
            self.meter,
            time.monotonic(),
            in_flight=sum(r.load for r in self.rules.replicas.values()),
            backlog=len(self.rules.waiting),
            per_replica=self.rules.slots_per_replica(),
            admit_bound=sum(lane.admit_bound for lane in self.lanes.values()),
            config=self.scaling,
        )

    async def export_signal(self) -> ScalingSignal:
        signal = self.signal()
        export_fleet_gauges(self.fleet, signal)
        fields = {k: str(v) for k, v in signal.as_dict().items()}
        await self.redis.hset(keys.fleet_scaling(self.fleet), mapping={**fields, "time": str(time.time())})
        return signal

    async def watch(self) -> None:
        """Keeps the registry refresh and the signal running while any lane watches (returns on cancel)."""
        self.watchers += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        try:
            await asyncio.Event().wait()
        finally:
            self.watchers -= 1
            if self.watchers == 0:
                self._cancel_loop()

    def _cancel_loop(self) -> None:
        """Asks the refresh and signal loop to end (a later watcher starts a new one)."""
        if self._task is not None:
            self._task.cancel()
            self._ending.add(self._task)
            self._task = None

    async def _stop_loop(self) -> None:
        """Ends the loop and waits until it has, so it writes no signal after this."""
        self._cancel_loop()
        ending, self._ending = self._ending, set()
        await asyncio.gather(*ending, return_exceptions=True)

    async def _loop(self) -> None:
        last_export = time.monotonic()
        while True:
            cancel_point()
            try:
                await self.refresh()
                if time.monotonic() - last_export >= self.scaling.interval_s:
                    last_export = time.monotonic()
                    await self.export_signal()
            except Exception:  # tolerated: Redis restarting; the next refresh catches up
                log.warning("fleet %s: replica discovery or signal failed", self.fleet, exc_info=True)
            await asyncio.sleep(min(REFRESH_S, self.scaling.interval_s))

    async def close_lane(self, run_id: str) -> None:
        """The run left the fleet's share: its waiting requests are dropped; after the last run, the
        channels close, the fleet's gauges go and its signal key is deleted (no demand left)."""
        self.lanes.pop(run_id, None)
        for request in self.rules.remove_run(run_id):
            future = self.granted.get(request)
            if future is not None and not future.done():
                future.cancel()
        self.dispatch()
        if self.lanes:
            return
        channels, self.channels = self.channels, {}
        await self._stop_loop()
        for channel in channels.values():
            await channel.close(None)
        if self.lanes:  # a run joined meanwhile: the fleet is in use again
            return
        clear_fleet_gauges(self.fleet)
        with contextlib.suppress(Exception):  # Redis restarting: the key is rewritten by the next run
            await self.redis.delete(keys.fleet_scaling(self.fleet))


class FleetLane:
    """One run's view of its fleet, with the interface of a run's own `ReplicaPool` (what the pipeline
    uses: acquire, release, stub, watch, close, load, waiting, meter)."""

    def __init__(self, scheduler: FleetScheduler, run_id: str, admit_bound: int, meter: BusyMeter) -> None:
        self.scheduler, self.run_id, self.admit_bound, self.meter = scheduler, run_id, admit_bound, meter
        self.closed = False
        """The run left the fleet's share (`close`): a request now is abandoned (CancelledError)."""

    @property
    def load(self) -> dict[str, int]:
        """The run's groups in flight per replica."""
        return self.scheduler.rules.run_load(self.run_id)

    @property
    def waiting(self) -> int:
        """The run's groups waiting for a slot."""
        return sum(r.run_id == self.run_id for r in self.scheduler.rules.waiting)

    async def acquire(self, adapter: str = BASE_ADAPTER, version: int = 0) -> str:
        """A slot for one of the run's groups on `adapter` at `version` or newer; CancelledError once the
        lane is closed (the pipeline ended: a group retried after its call was cancelled asks for no
        slot)."""
        if self.closed:
            raise asyncio.CancelledError
        return await self.scheduler.acquire(self.run_id, adapter, version)

    async def release(self, address: str, *, failed: bool = False) -> None:
        await self.scheduler.release(self.run_id, address, failed=failed)

    def stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        return self.scheduler.stub(address)

    async def watch(self) -> None:
        await self.scheduler.watch()

    async def close(self) -> None:
        self.closed = True
        await self.scheduler.close_lane(self.run_id)
