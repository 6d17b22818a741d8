"""`GET /v1/fleets/{fleet}`: a shared rollout fleet as Redis holds it, for operators.

The body lists the fleet's members (the runs generating on it, `keys.fleet_members`), its registered
replicas with the adapters each serves and its load (`in_flight` of `capacity`, as the replica reports
them in the registry), and the fleet's autoscaling signal summed over its runs (`keys.fleet_scaling`,
written by the coordinator's `fleet.FleetScheduler` while a run is on the fleet; None otherwise). A fleet
nobody uses answers empty lists. Operator-only: a run's own token gets 403 (a fleet shows other runs).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Request
from pydantic import BaseModel, Field

from rlfabric.contracts import fleet, keys, registry
from rlfabric.contracts.streams import as_str
from rlfabric.coordinator.api_auth import bearer_auth
from rlfabric.coordinator.api_errors import responses
from rlfabric.runspec import RUN_NAME_PATTERN

FleetName = Annotated[str, Path(pattern=RUN_NAME_PATTERN, description="The fleet's name (`rollout.fleet`)")]


class FleetMemberBody(BaseModel):
    """One run on the fleet."""

    run_id: str
    """The run's id."""
    adapter: str
    """The name of the run's adapter on the fleet's replicas."""
    weights_root: str
    """Where the run's learner publishes its adapter versions."""
    weight: float
    """The run's fair-share weight (`rollout.fleet_weight`)."""


class FleetReplicaBody(BaseModel):
    """One replica registered under the fleet."""

    replica_id: str
    """The replica's id."""
    address: str
    """Its gRPC address."""
    serving: bool
    """Serving (a model loaded)."""
    draining: bool
    """Shutting down: it takes no new work."""
    in_flight: int
    """Prompts it holds now (as it last reported)."""
    capacity: int
    """Prompts it holds at most."""
    adapters: dict[str, int]
    """The adapters it serves: name -> version."""


class FleetBody(BaseModel):
    """Body of `GET /v1/fleets/{fleet}`."""

    fleet: str
    """The fleet's name."""
    members: list[FleetMemberBody] = Field(default_factory=list)
    """The runs generating on it, by run id."""
    replicas: list[FleetReplicaBody] = Field(default_factory=list)
    """Its registered replicas, by id."""
    scaling: dict[str, float] | None = None
    """The fleet's signal summed over its runs (`ScalingSignal` fields and `time`, epoch seconds); None
    while no coordinator has written one (no run on the fleet)."""


async def fleet_body(redis: Any, name: str) -> FleetBody:
    """The fleet as Redis holds it now."""
    members = await fleet.members(redis, name)
    entries = await registry.discover(redis, keys.fleet_scope(name))
    raw = await redis.hgetall(keys.fleet_scaling(name))
    return FleetBody(
        fleet=name,
        members=[FleetMemberBody(**asdict(members[run_id])) for run_id in sorted(members)],
        replicas=[replica_body(e) for e in entries],
        scaling={as_str(k): float(as_str(v)) for k, v in raw.items()} if raw else None,
    )


def replica_body(entry: registry.ReplicaEntry) -> FleetReplicaBody:
    return FleetReplicaBody(
        replica_id=entry.replica_id,
        address=entry.address,
        serving=entry.serving,
        draining=entry.draining,
        in_flight=entry.in_flight,
        capacity=entry.capacity,
        adapters=entry.adapter_versions(),
    )


def add_fleet_route(app: FastAPI, token: str | None) -> None:
    """Adds the route behind the operator's bearer token (`api.token`)."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(token))], tags=["fleets"])

    @router.get(
        "/fleets/{fleet}",
        response_model=FleetBody,
        responses=responses("get_fleet"),
    )
    async def get_fleet(fleet: FleetName, request: Request) -> FleetBody:
        """The fleet's members, its replicas (adapters, load) and its summed autoscaling signal."""
        return await fleet_body(request.app.state.store.redis, fleet)

    app.include_router(router)
