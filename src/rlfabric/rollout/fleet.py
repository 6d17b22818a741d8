"""A fleet replica's follow loop: the adapters it holds follow its fleet's members and their versions.

A replica started with `fleet` set (`RolloutServiceConfig.fleet`) is bound to no run. Every
`version_poll_s` it reads the fleet's members (`contracts.fleet.members`) and the version each member's
learner announced (`keys.version(run)`), then:
1. unloads the adapters it loaded for runs that are no longer members, so their slots free first;
2. loads, for each member (by run id), an announced adapter version newer than the one it holds, from the
   member's weights root as the member's adapter, through the servicer's update path (the one the
   learner's UpdateWeights takes: staged and verified before anything drains);
3. when anything changed, beats the registry heartbeat at once, so the coordinator sees the adapters the
   replica now lists (`ReplicaEntry.adapters`) without waiting a heartbeat interval.

Faults are tolerated and retried: a Redis error is logged and read again at the next poll; a version that
fails to load (it does not verify, is not an adapter, the engine refuses it) is skipped until the member
announces a newer one, its old version serving on; a member with no free slot (`engine.max_adapters`) is
logged once and retried at every poll until a slot frees; a failed unload is retried at the next poll.
Adapters loaded otherwise (an UpdateWeights RPC) are left alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.contracts import fleet, keys
from rlfabric.contracts.fleet import FleetMember
from rlfabric.runtime.errors import NotFound, ResourceExhausted
from rlfabric.v1 import rollout_pb2

if TYPE_CHECKING:
    from rlfabric.rollout.main import Parts
    from rlfabric.rollout.server import RolloutServicer

log = logging.getLogger(__name__)


@dataclass
class FleetFollower:
    """What a fleet replica remembers between polls, and one poll (`poll`)."""

    fleet: str
    redis: Any
    servicer: RolloutServicer
    on_change: Callable[[], Awaitable[None]] | None = None
    """Called after a poll that loaded or unloaded an adapter (the heartbeat's beat)."""
    loaded: set[str] = field(default_factory=set)
    """Adapter names this loop loaded (and may unload when their run leaves)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Run id -> the announced version that failed to load (skipped until a newer one is announced)."""
    without_slot: set[str] = field(default_factory=set)
    """Run ids already logged as waiting for a free adapter slot."""

    async def poll(self) -> None:
        """One round: read the members and their versions, unload the departed, load the newer."""
        try:
            members, announced = await self.read()
        except Exception:  # tolerated: Redis may be restarting; read again at the next poll
            log.warning("could not read the members of fleet %s", self.fleet, exc_info=True)
            return
        self.servicer.replica.awaited_adapters = frozenset(m.adapter for m in members)
        self.forget_departed(members)
        changed = await self.unload_departed(members)
        for member in members:
            changed = await self.follow(member, announced.get(member.run_id, 0)) or changed
        if changed and self.on_change is not None:
            await self.on_change()

    async def read(self) -> tuple[list[FleetMember], dict[str, int]]:
        """The members (by run id) and each one's announced version (0 when none yet)."""
        current = await fleet.members(self.redis, self.fleet)
        runs = sorted(current)
        values = await self.redis.mget([keys.version(run) for run in runs]) if runs else []
        return [current[run] for run in runs], {run: int(v or 0) for run, v in zip(runs, values, strict=True)}

    def forget_departed(self, members: list[FleetMember]) -> None:
        """Drops what was remembered about runs that left (a run that rejoins starts afresh)."""
        runs = {m.run_id for m in members}
        self.failed = {run: v for run, v in self.failed.items() if run in runs}
        self.without_slot &= runs

    async def unload_departed(self, members: list[FleetMember]) -> bool:
        """Unloads the adapters this loop loaded whose run is no longer a member; True if any was."""
        departed = sorted(self.loaded - {m.adapter for m in members})
        changed = False
        for name in departed:
            changed = await self.unload(name) or changed
        return changed

    async def unload(self, name: str) -> bool:
        try:
            reply = await self.servicer.unload(name)
        except NotFound:  # already unloaded (an UnloadAdapter RPC): nothing left to free
            self.loaded.discard(name)
            return False
        except Exception:  # tolerated: retried at the next poll
            log.exception("could not unload adapter %s of a run that left fleet %s", name, self.fleet)
            return False
        self.loaded.discard(name)
        log.info("unloaded adapter %s version %d (its run left fleet %s; %d prompts aborted)",
                 name, reply.version, self.fleet, reply.aborted)  # fmt: skip
        return True

    def held_version(self, adapter: str) -> int:
        """The version of `adapter` this replica serves (0 when it holds none)."""
        slot = self.servicer.replica.adapters.get(adapter)
        return slot.version if slot is not None and slot.version is not None else 0

    async def follow(self, member: FleetMember, announced: int) -> bool:
        """Loads `member`'s announced version when newer than the one held; True if it loaded."""
        if announced <= self.held_version(member.adapter) or self.failed.get(member.run_id) == announced:
            return False
        request = rollout_pb2.UpdateWeightsRequest(
            version=announced,
            adapter=member.adapter,
            object_store=rollout_pb2.ObjectStoreSource(root_url=member.weights_root),
        )
        try:
            await self.servicer.update(request)
        except ResourceExhausted:  # every slot held: retried at each poll until one frees
            self.log_without_slot(member)
            return False
        except Exception:  # tolerated: the old version (if any) keeps serving
            self.failed[member.run_id] = announced
            log.exception("could not load adapter %s version %d of run %s from %s; skipped until a newer "
                          "version is announced", member.adapter, announced, member.run_id,
                          member.weights_root)  # fmt: skip
            return False
        self.loaded.add(member.adapter)
        self.without_slot.discard(member.run_id)
        log.info("serving adapter %s version %d (run %s of fleet %s)", member.adapter, announced,
                 member.run_id, self.fleet)  # fmt: skip
        return True

    def log_without_slot(self, member: FleetMember) -> None:
        """Logs once per member that no adapter slot is free for it."""
        if member.run_id in self.without_slot:
            return
        self.without_slot.add(member.run_id)
        capacity = self.servicer.replica.adapters.capacity
        log.warning("no free adapter slot for run %s of fleet %s (all %d slots, engine.max_adapters, held): "
                    "retried as slots free", member.run_id, self.fleet, capacity)  # fmt: skip


async def follow_fleet(parts: Parts) -> None:
    """The fleet replica's follow loop: one `FleetFollower.poll` every `version_poll_s`."""
    assert parts.servicer is not None and parts.redis is not None and parts.config.fleet
    follower = FleetFollower(parts.config.fleet, parts.redis, parts.servicer, lambda: beat_now(parts))
    while True:
        await follower.poll()
        await asyncio.sleep(parts.config.version_poll_s)


async def beat_now(parts: Parts) -> None:
    """Re-registers the replica's entry now (its adapters changed)."""
    if parts.heartbeat is None:
        return
    try:
        await parts.heartbeat.beat()
    except Exception:  # tolerated: the next regular beat carries the change
        log.warning("could not register the replica's new adapters", exc_info=True)
