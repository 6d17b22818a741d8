"""The rollout replica registry in Redis: replicas announce themselves, the coordinator discovers them.

Each replica owns one hash, `keys.replica(run, replica_id)`, refreshed by a heartbeat and given a
TTL of `ttl_s`: a replica that dies without deregistering disappears when its entry expires, and one that
scales out appears at its first beat, so the coordinator sees scale-out and scale-in without restarts.
A replica being removed (scale-in, SIGTERM) first marks its entry `draining`: it admits no new work and the
coordinator sends it none, it finishes what it holds, then deletes its entry and exits. Replicas not bound
to a run use the run id "_"; the replicas of a shared fleet use the fleet's scope
(`keys.fleet_scope`), and list the adapters they serve (`ReplicaEntry.adapters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rlfabric.contracts import keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaEntry:
    """What a replica publishes about itself. `version` is meaningful only when `serving`; a replica takes
    new work only when `serving` and not `draining`."""

    replica_id: str
    address: str
    version: int
    serving: bool
    in_flight: int
    capacity: int
    model: str
    engine: str
    draining: bool = False
    """Shutting down: finishing its admitted requests, admitting none (never dispatch to it)."""
    adapters: str = ""
    """The LoRA adapters the replica serves, as JSON `{name: version}` ("" or "{}" for none): a fleet's
    scheduler sends a run's requests on its adapter only to replicas that hold it."""

    @staticmethod
    def encode_adapters(versions: Mapping[str, int]) -> str:
        """`adapters` of a replica serving these adapter versions (name -> version)."""
        return json.dumps(dict(versions), sort_keys=True)

    def adapter_versions(self) -> dict[str, int]:
        """`adapters` decoded: adapter name -> the version serving."""
        if not self.adapters:
            return {}
        return {str(k): int(v) for k, v in json.loads(self.adapters).items()}

    @property
    def takes_work(self) -> bool:
        """Serving and not draining: the coordinator may dispatch to it."""
        return self.serving and not self.draining

    def to_hash(self) -> dict[str, str]:
        return {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, data: dict[str, str]) -> ReplicaEntry:
        return cls(
            replica_id=data["replica_id"],
            address=data["address"],
            version=int(data["version"]),
            serving=data["serving"] == "1",
            in_flight=int(data["in_flight"]),
            capacity=int(data["capacity"]),
            model=data["model"],
            engine=data["engine"],
            draining=data.get("draining", "0") == "1",
            adapters=data.get("adapters", ""),
        )


async def register(redis: Any, run_id: str | None, entry: ReplicaEntry, ttl_s: float) -> None:
    """Writes (or refreshes) the entry and its TTL in one transaction."""
    key = keys.replica(run_id, entry.replica_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping=entry.to_hash())
        pipe.pexpire(key, int(ttl_s * 1000))
        await pipe.execute()


async def deregister(redis: Any, run_id: str | None, replica_id: str) -> None:
    await redis.delete(keys.replica(run_id, replica_id))


async def discover(redis: Any, run_id: str | None) -> list[ReplicaEntry]:
    """Every live replica of the run, sorted by id."""
    entries = []
    async for key in redis.scan_iter(match=keys.replica(run_id, "*"), count=100):
        data = await redis.hgetall(key)
        if data:
            entries.append(ReplicaEntry.from_hash(_decode(data)))
    return sorted(entries, key=lambda e: e.replica_id)


def _decode(data: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in data.items()
    }


class Heartbeat:
    """Re-registers `snapshot()` every `interval_s` (TTL = 3 intervals) until stopped; a Redis error is
    logged and retried at the next beat, so a Redis restart costs at most a few beats of visibility."""

    def __init__(self, redis: Any, run_id: str | None, snapshot: Any, interval_s: float) -> None:
        self.redis, self.run_id, self.snapshot, self.interval_s = redis, run_id, snapshot, interval_s
        self.beats = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def beat(self) -> None:
        await register(self.redis, self.run_id, self.snapshot(), ttl_s=3 * self.interval_s)
        self.beats += 1

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
            except Exception:  # tolerated: Redis may be restarting; counted and retried
                self.failures += 1
                log.warning("registry heartbeat failed", exc_info=True)

    async def stop(self, *, deregister_entry: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if deregister_entry:
            await deregister(self.redis, self.run_id, self.snapshot().replica_id)
