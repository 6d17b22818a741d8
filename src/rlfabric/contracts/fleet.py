"""Shared rollout fleets: which runs generate on a fleet, as the coordinator tells the fleet's replicas.

A fleet is a set of rollout replicas serving one base model and the LoRA adapters of several runs at once
(`rollout.fleet` in the run spec, `fleet` in the replica's settings). Its replicas register under the
fleet's scope (`keys.fleet_scope`) instead of a run id. The coordinator keeps `keys.fleet_members(fleet)`:
a run joins when its pipeline starts and leaves when the run ends (whatever the final state), so the
replicas load each member's adapter versions from the member's weights root as the learner announces them
(`keys.version(run)`), and unload the adapter of a run that left, freeing its slot.

Imports nothing but the standard library and the contracts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from rlfabric.contracts import keys
from rlfabric.contracts.streams import as_str


@dataclass(frozen=True)
class FleetMember:
    """One run on a fleet, as its replicas need it."""

    run_id: str
    adapter: str
    """The adapter's name on the replicas (`weights.adapters.run_adapter_name(run_id)`)."""
    weights_root: str
    """Where the run's learner publishes its adapter versions (`weights.url` of the run spec)."""
    weight: float = 1.0
    """The run's fair-share weight (`rollout.fleet_weight`)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> FleetMember:
        data = json.loads(text)
        weight = float(data.get("weight", 1.0))
        return cls(str(data["run_id"]), str(data["adapter"]), str(data["weights_root"]), weight)


async def join(redis: Any, fleet: str, member: FleetMember) -> None:
    """Adds (or updates) `member` on `fleet`."""
    await redis.hset(keys.fleet_members(fleet), member.run_id, member.to_json())


async def leave(redis: Any, fleet: str, run_id: str) -> None:
    """Removes run `run_id` from `fleet` (a no-op when it is not a member)."""
    await redis.hdel(keys.fleet_members(fleet), run_id)


async def members(redis: Any, fleet: str) -> dict[str, FleetMember]:
    """The runs on `fleet`, by run id."""
    raw = await redis.hgetall(keys.fleet_members(fleet))
    return {as_str(k): FleetMember.from_json(as_str(v)) for k, v in raw.items()}
