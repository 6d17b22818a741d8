"""The serving rollout replicas of a run, as the pipeline sees them: discovered in the Redis registry,
balanced client-side (least loaded first, at most `per_replica` groups each and never more than the
replica's registered `capacity`, which it would refuse as RESOURCE_EXHAUSTED), a failed one excluded for
a while. Work goes only to replicas the registry lists as taking work: a draining replica (scale-in) or
one gone from the registry gets nothing new while its groups in flight finish. Every load change goes to
the run's busy meter (the autoscaling signal)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc

from rlfabric.contracts import registry
from rlfabric.coordinator.scaling import BusyMeter
from rlfabric.runtime.aio import cancel_point
from rlfabric.runtime.grpc_client import make_channel
from rlfabric.v1 import rollout_pb2_grpc

log = logging.getLogger(__name__)

REPLICA_BACKOFF_S = 5.0
"""How long a replica whose generation failed gets no new work."""


class ReplicaPool:
    """Serving replicas of the run, refreshed from the registry; client-side least-loaded balancing.
    Every change of a replica's load goes to the busy meter; `waiting` counts groups that wait for a slot.
    `token` (the replicas' `client_token`) is sent on every call made through `stub`."""

    def __init__(
        self, redis: Any, run_id: str, per_replica: int, meter: BusyMeter, *, token: str | None = None
    ) -> None:
        self.redis, self.run_id, self.per_replica, self.meter = redis, run_id, per_replica, meter
        self.token = token
        self.load: dict[str, int] = {}
        """Groups in flight per replica, kept until they finish even after the replica left `live`."""
        self.capacity: dict[str, int] = {}
        """The replicas the registry lists as taking work (serving, not draining), the only ones dispatched
        to, with the capacity each registered (prompts it admits at once; a group is one prompt)."""
        self.excluded: dict[str, float] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.changed = asyncio.Condition()
        self.waiting = 0

    async def refresh(self) -> None:
        entries = await registry.discover(self.redis, self.run_id)
        capacity = {e.address: e.capacity for e in entries if e.takes_work}
        live = capacity.keys()
        async with self.changed:
            self.capacity = capacity
            now = time.monotonic()
            for address in live - self.load.keys():
                self.load[address] = 0
                self.meter.seen(address, now)
            for address in self.load.keys() - live:
                if self.load[address] == 0:
                    del self.load[address]
                    self.meter.gone(address, now)
            self.changed.notify_all()

    async def watch(self, interval_s: float = 1.0) -> None:
        while True:
            cancel_point()
            try:
                await self.refresh()
            except Exception:  # tolerated: Redis restarting; the next refresh catches up
                log.warning("replica discovery failed", exc_info=True)
            await asyncio.sleep(interval_s)

    @property
    def live(self) -> set[str]:
        """Replicas the registry lists as taking work."""
        return set(self.capacity)

    def _best(self) -> str | None:
        now = time.monotonic()
        ready = [
            a
            for a, n in self.load.items()
            if a in self.capacity
            and n < min(self.per_replica, self.capacity[a])
            and self.excluded.get(a, 0) <= now
        ]
        return min(ready, key=lambda a: self.load[a]) if ready else None

    async def acquire(self, adapter: str = "", version: int = 0) -> str:
        """The least-loaded replica with a free slot (waiting for one). Every replica of the run serves
        the run's adapter and waits for the version itself, so `adapter` and `version` (the request's, as a
        fleet's lane needs them) do not matter here."""
        del adapter, version
        async with self.changed:
            self.waiting += 1
            try:
                while (address := self._best()) is None:
                    cancel_point()
                    await self._wait()
            finally:
                self.waiting -= 1
            self.load[address] += 1
            self.meter.update(address, self.load[address], time.monotonic())
            return address

    async def _wait(self) -> None:
        """Up to 1 s for a change. `asyncio.timeout`, not `wait_for`: Python 3.11's `wait_for` can swallow
        a cancellation that arrives as its timeout fires, and `acquire` would then wait for a replica
        forever (seen as a coordinator that never finished cancelling a run without replicas)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self.changed.wait()

    async def release(self, address: str, *, failed: bool = False) -> None:
        async with self.changed:
            if address in self.load:
                self.load[address] -= 1
                self.meter.update(address, self.load[address], time.monotonic())
            if failed:
                self.excluded[address] = time.monotonic() + REPLICA_BACKOFF_S
            self.changed.notify_all()

    def stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self.channels:
            self.channels[address] = make_channel(address, bearer_token=self.token)
        return rollout_pb2_grpc.RolloutServiceStub(self.channels[address])

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close(None)
