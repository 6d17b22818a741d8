"""`GET /v1/runs/{run_id}/plan`: the memory plan of a run that declares `[resources]` (`rlfabric plan
--json`'s schema), next to the memory the learner reports in its metrics rows, for the run page.

`measured` holds every numeric key of the latest metrics row whose name contains "memory": the learner's
`memory_peak_bytes` (rank 0's peak RSS on CPU, allocated CUDA memory on a GPU) once it trained a step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from pydantic import BaseModel, Field

from rlfabric.coordinator.api_auth import RunId, Store, authenticate, run_access
from rlfabric.coordinator.api_errors import responses
from rlfabric.runspec import RunSpec

MEMORY_KEY_PART = "memory"
"""A metrics-row key holding this is shown as measured memory beside the plan."""


class PlanBody(BaseModel):
    """Body of `GET /v1/runs/{run_id}/plan`."""

    plan: dict[str, Any] | None = None
    """The plan (`rlfabric.plan.report.to_json`); None when it was not made (`reason` says why)."""
    reason: str | None = None
    """Why there is no plan: the run declares no resources, or the model's config was not found."""
    measured: dict[str, float] = Field(default_factory=dict)
    """Memory the learner reports in its latest metrics row, by key (empty until it reports any)."""


def plan_of(spec: RunSpec) -> tuple[dict[str, Any] | None, str | None]:
    """(plan, None) or (None, why not)."""
    if spec.resources is None:
        return None, "the run declares no [resources]: not planned"
    from rlfabric.plan.planner import PlanError, make_plan
    from rlfabric.plan.report import to_json

    try:
        return to_json(make_plan(spec)), None
    except PlanError as exc:
        return None, f"not planned: {exc}"


def measured_memory(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The memory keys of the latest row."""
    latest = rows[-1] if rows else {}
    return {
        k: float(v)
        for k, v in latest.items()
        if MEMORY_KEY_PART in k and isinstance(v, int | float) and not isinstance(v, bool)
    }


def add_plan_route(app: FastAPI, token: str | None) -> None:
    """Adds the route behind the run routes' bearer token: the operator's, or the run's own."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate(token))], tags=["runs"])

    @router.get(
        "/runs/{run_id}/plan",
        response_model=PlanBody,
        responses=responses("get_plan"),
        dependencies=[Depends(run_access(token))],
    )
    async def get_plan(run_id: RunId, store: Store) -> PlanBody:
        """The run's memory plan and the memory its learner reports."""
        record = await store.get(run_id)
        plan, reason = await asyncio.to_thread(plan_of, record.spec)
        measured = measured_memory(await store.recent_metrics(run_id, 1))
        return PlanBody(plan=plan, reason=reason, measured=measured)

    app.include_router(router)
