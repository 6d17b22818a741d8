"""The coordinator's preference-build routes: `rlfabric prefs build` as a job.

    POST /v1/prefs/builds          the pipeline file's content as JSON; 202 with the queued build
    GET  /v1/prefs/builds          builds, newest first
    GET  /v1/prefs/builds/{id}     state, the version (id and folder) once done, its summary, the error

The body is validated as the pipeline file is (`prefs.spec.PipelineSpec`) and then against the operator's
limits (`prefs_limits`); either answers 422 naming each field. The body limit is the run routes'; the
bearer token is the operator's alone (`api.bearer_auth`: a run's own token gets 403). Builds run as child
processes (`prefs_builds.PrefsBuilds`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlfabric.coordinator.api_auth import bearer_auth
from rlfabric.coordinator.api_errors import responses
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.prefs_builds import (
    BUILD_ID_PATTERN,
    BuildList,
    BuildNotFound,
    BuildRecord,
    PrefsBuilds,
    TooManyBuilds,
)
from rlfabric.coordinator.prefs_limits import pipeline_issues
from rlfabric.prefs.spec import PipelineSpec
from rlfabric.runtime.paths import Roots

BuildId = Annotated[str, Path(pattern=BUILD_ID_PATTERN, description="The build's id")]


def _builds(request: Request) -> PrefsBuilds:
    builds: PrefsBuilds = request.app.state.prefs_builds
    return builds


Builds = Annotated[PrefsBuilds, Depends(_builds)]


def refuse_limits(spec: PipelineSpec, builds: PrefsBuilds, roots: Roots) -> None:
    """RequestValidationError (422) naming each field the operator's limits refuse."""
    errors = [
        {"loc": ("body", *i.loc), "msg": i.message, "type": i.kind}
        for i in pipeline_issues(spec, builds.config, roots)
    ]
    if errors:
        raise RequestValidationError(errors)


def prefs_routes(token: str | None, roots: Roots) -> APIRouter:
    """The /v1/prefs routes; pipelines may name paths only within `roots`."""
    router = APIRouter(prefix="/v1/prefs", dependencies=[Depends(bearer_auth(token))], tags=["prefs"])

    @router.post(
        "/builds",
        status_code=status.HTTP_202_ACCEPTED,
        response_model=BuildRecord,
        responses=responses("submit_prefs_build"),
    )
    async def submit_prefs_build(
        spec: PipelineSpec, request: Request, builds: Builds, response: Response
    ) -> BuildRecord:
        """Queue a build of a pipeline (the pipeline file's content as JSON); 422 naming the field when it
        is invalid or names what the operator does not allow, 429 when `prefs.max_queued` builds wait."""
        refuse_limits(spec, builds, roots)
        body: dict[str, Any] = await request.json()
        record = builds.submit(spec.name, body)
        response.headers["Location"] = f"/v1/prefs/builds/{record.build_id}"
        return record

    @router.get("/builds", response_model=BuildList, responses=responses("list_prefs_builds"))
    async def list_prefs_builds(
        builds: Builds, limit: Annotated[int, Query(ge=1, le=1000)] = 100
    ) -> BuildList:
        """Builds, newest first."""
        return BuildList(builds=builds.newest(limit))

    @router.get("/builds/{build_id}", response_model=BuildRecord, responses=responses("get_prefs_build"))
    async def get_prefs_build(build_id: BuildId, builds: Builds) -> BuildRecord:
        """One build: its state, and once done its version (id, folder, summary) or its error."""
        return builds.get(build_id)

    return router


def add_prefs_builds(app: FastAPI, config: CoordinatorServiceConfig, roots: Roots) -> PrefsBuilds:
    """Serves the prefs routes on `app` with their builds (`app.state.prefs_builds`; close them at
    shutdown) and their errors: 404 for an unknown build, 429 past `prefs.max_queued`."""

    async def not_found(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_404_NOT_FOUND)

    async def too_many(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_429_TOO_MANY_REQUESTS)

    builds = PrefsBuilds(config.prefs)
    app.state.prefs_builds = builds
    app.include_router(prefs_routes(config.api.token, roots))
    app.add_exception_handler(BuildNotFound, not_found)
    app.add_exception_handler(TooManyBuilds, too_many)
    return builds
