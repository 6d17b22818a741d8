"""The coordinator's REST API (FastAPI): submit, list, inspect and stop runs; the run page; health; metrics.

Routes under /v1 need `Authorization: Bearer <token>` when `config.api.token` is set (compared in constant
time); /healthz, /metrics, the API docs (/docs, /redoc, /openapi.json: `api_docs`, no CDN) and the HTML shell
of the run page do not (the page's script sends the token it is given, see `page.py`). Two kinds of token are
accepted (`api_auth.Caller`): the operator's `api.token`, which may do everything, and a run's own token,
answered by `POST /v1/runs` once (`run_token`; Redis keeps only its digest, `runs.token_matches`), which may
read and stop that run alone: another run's routes answer 403, the list of runs holds its run only, and
submitting runs or preference builds needs the operator's (403). Bodies over `config.api.max_body_bytes` get
413 (`api_errors.BodyLimit`), whether announced by Content-Length or streamed. The app only records runs; the
pipeline manager hooks in with `on_submit` (awaited after a run is stored) and `on_stop` (awaited after a
stop was recorded).

Inputs are bounded and confined: the run spec's types are strict and its integers bounded (see
`runspec.SpecModel`); its dataset and model paths must lie in the configured `data_roots` / `model_roots`
(422 naming the field, never saying whether the file exists); within them, a run that cannot run (unknown
scorer or parameters, missing paths, model files that do not load, missing dataset columns:
`rlfabric.validate`) is refused with 422 naming the field, when the app is given a check. Run ids and `since`
stream ids are checked before Redis sees them. Every route's possible answers are in the OpenAPI document
(`api_errors.ROUTE_ERRORS`), each error with its body model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import Counter
from pydantic import AfterValidator, BaseModel
from redis.asyncio import Redis

from rlfabric.coordinator.api_auth import Caller, RunId, Store, authenticate, bearer_auth, run_access
from rlfabric.coordinator.api_docs import add_docs
from rlfabric.coordinator.api_errors import BodyLimit, responses
from rlfabric.coordinator.config import CoordinatorServiceConfig
from rlfabric.coordinator.health import HEALTH_ROWS, LEARNER_STALL_S, evaluations, length_limit, run_health
from rlfabric.coordinator.http_metrics import RequestMetrics
from rlfabric.coordinator.http_tracing import RequestSpans
from rlfabric.coordinator.liveness import liveness_warnings
from rlfabric.coordinator.page import render_run_page
from rlfabric.coordinator.refusal import RunRefusal, refusal_extras
from rlfabric.coordinator.runs import (
    InvalidTransition,
    RunExists,
    RunNotFound,
    RunRecord,
    RunState,
    RunStore,
    parse_stream_id,
)
from rlfabric.runspec import RunSpec
from rlfabric.runtime.metrics import metrics_response
from rlfabric.runtime.paths import Roots, violations
from rlfabric.validate import CheckReport

RunHook = Callable[[RunRecord], Awaitable[None]]
SpecCheck = Callable[[RunSpec], Awaitable[CheckReport]]
"""Checks a submitted spec against the world (`checks.SubmitCheck`); its issues refuse the run (422)."""

_REQUESTS = Counter("rlfabric_coordinator_api_runs_total", "Run API actions", ["action"])


class SubmittedRun(RunRecord):
    """Body of `POST /v1/runs`: the stored record and the run's own token."""

    run_token: str
    """The run's bearer token: it reads and stops this run only (the operator's `api.token` does all).
    Shown this once: the coordinator keeps only its SHA-256, and no other answer holds it."""


class RunSummary(BaseModel):
    """A run in `GET /v1/runs`."""

    run_id: str
    name: str
    state: RunState
    step: int
    policy_version: int
    created_at: str
    updated_at: str
    error: str | None


class RunList(BaseModel):
    """Body of `GET /v1/runs`, newest first."""

    runs: list[RunSummary]


class EvaluationSummary(BaseModel):
    """The latest held-out evaluation of a run (from its metrics rows, `health.evaluations`)."""

    step: int
    """The learner step the evaluation ran at."""
    policy_version: int
    """The lowest policy version it sampled."""
    reward: float | None
    """The run's own (proxy) reward: `eval_reward_mean`."""
    gold_reward: float | None
    """The gold reward (`dataset.eval.reward`): `eval_gold_reward_mean`; None without one."""
    kl: float | None
    """The learner's mean KL to the reference at that step."""
    gold_peak: float | None
    """The highest gold reward of the recent evaluations (the last 500 metrics rows); None without one."""
    gold_peak_step: int | None
    """The policy version (= learner step) of that peak."""


class RunStatus(RunRecord):
    """Body of `GET /v1/runs/{id}`: the record, its counters, the latest metrics row, the latest held-out
    evaluation and all warnings (recorded ones, then health warnings computed from the metrics series)."""

    counters: dict[str, int]
    latest_metrics: dict[str, Any] | None
    scaling: dict[str, float] | None = None
    """The latest autoscaling signal: replicas, busy_fraction, run_busy_fraction, in_flight_groups,
    backlog_groups, desired_replicas, time (None before the pipeline exported one)."""
    evaluation: EvaluationSummary | None = None
    """The latest held-out evaluation (None before the first)."""


def evaluation_summary(rows: list[dict[str, Any]]) -> EvaluationSummary | None:
    """The latest evaluation in `rows`, with the gold reward's peak among them."""
    found = evaluations(rows)
    if not found:
        return None
    last = found[-1]
    golds = [e for e in found if e.gold is not None]
    peak = max(golds, key=lambda e: e.gold or 0.0) if golds else None
    return EvaluationSummary(
        step=last.step,
        policy_version=last.policy_version,
        reward=last.proxy,
        gold_reward=last.gold,
        kl=last.kl,
        gold_peak=peak.gold if peak else None,
        gold_peak_step=peak.policy_version if peak else None,
    )


class MetricsPage(BaseModel):
    """Body of `GET /v1/runs/{id}/metrics`: rows oldest first; pass `last_id` as `since` for the next."""

    run_id: str
    rows: list[dict[str, Any]]
    last_id: str | None


class HealthBody(BaseModel):
    """Body of `GET /healthz`."""

    status: str
    """ok, or unavailable when Redis does not answer."""
    redis: str | None = None
    """With unavailable: the kind of error Redis gave (its class name, nothing more)."""


def _stream_id(value: str | None) -> str | None:
    if value is not None:
        parse_stream_id(value)
    return value


SinceId = Annotated[
    str | None,
    Query(max_length=41, description="Stream id of the last row already held, e.g. 1700000000000-0"),
    AfterValidator(_stream_id),
]


async def validation_error(_: Request, exc: Exception) -> JSONResponse:
    """422 whose `message` names each offending field by its dotted path (e.g. `body.model.path`)."""
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
    body = {"detail": errors, "message": message, **refusal_extras(exc)}
    return JSONResponse(jsonable_encoder(body), status.HTTP_422_UNPROCESSABLE_CONTENT)


def confine(spec: RunSpec, roots: Roots) -> None:
    """RequestValidationError (422) naming each path field of `spec` outside its roots."""
    errors = [
        {"loc": ("body", *v.field.split(".")), "msg": v.message, "type": "path_not_allowed"}
        for v in violations(spec, roots)
    ]
    if errors:
        raise RequestValidationError(errors)


def refuse_issues(report: CheckReport) -> None:
    """RequestValidationError (422) naming the field of each issue the run check found."""
    errors = [{"loc": ("body", *i.loc), "msg": i.message, "type": i.kind} for i in report.issues]
    if errors:
        raise RunRefusal(errors, report)


def run_routes(
    token: str | None,
    roots: Roots,
    on_submit: RunHook | None,
    on_stop: RunHook | None,
    check: SpecCheck | None = None,
    learner_stall_s: float = LEARNER_STALL_S,
) -> APIRouter:
    """The /v1 routes; specs may name paths only within `roots`, and must pass `check` when given."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate(token))], tags=["runs"])
    add_run_list_routes(router, token, roots, on_submit, check)
    add_one_run_routes(router, token, on_stop, learner_stall_s)
    return router


def add_run_list_routes(
    router: APIRouter, token: str | None, roots: Roots, on_submit: RunHook | None, check: SpecCheck | None
) -> None:
    """`POST /v1/runs` (the operator's token only) and `GET /v1/runs`."""

    @router.post(
        "/runs",
        status_code=status.HTTP_201_CREATED,
        response_model=SubmittedRun,
        responses=responses("submit"),
        dependencies=[Depends(bearer_auth(token))],
    )
    async def submit(spec: RunSpec, store: Store, response: Response) -> SubmittedRun:
        """Accept a run spec (operator's token only); 409 if a run of that name exists, 422 if it names a
        path outside the roots or fails the run check (each issue naming its field). The answer holds the
        run's own token, `run_token`, this once."""
        confine(spec, roots)
        if check is not None:
            refuse_issues(await check(spec))
        record, run_token = await store.create_with_token(spec)
        _REQUESTS.labels("submit").inc()
        response.headers["Location"] = f"/v1/runs/{record.run_id}"
        if on_submit is not None:
            await _call_hook(store, record, on_submit)
        return SubmittedRun(**record.model_dump(), run_token=run_token)

    @router.get("/runs", response_model=RunList, responses=responses("list_runs"))
    async def list_runs(
        store: Store,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        state: Annotated[list[RunState] | None, Query()] = None,
        caller: Caller = Depends(authenticate(token)),  # noqa: B008
    ) -> RunList:
        """Runs, newest first (optionally only those in the given states); a run's token sees its run only."""
        records = await visible_runs(store, caller, limit, set(state) if state else None)
        return RunList(runs=[_summary(r) for r in records])


def add_one_run_routes(
    router: APIRouter, token: str | None, on_stop: RunHook | None, learner_stall_s: float
) -> None:
    """The routes of one run, `/v1/runs/{run_id}...`: the operator's token or that run's own."""
    one_run = [Depends(run_access(token))]

    @router.get(
        "/runs/{run_id}", response_model=RunStatus, responses=responses("get_run"), dependencies=one_run
    )
    async def get_run(run_id: RunId, store: Store) -> RunStatus:
        """State, progress, counters, the latest metrics row and warnings of one run."""
        return await run_status(store, run_id, learner_stall_s)

    @router.get(
        "/runs/{run_id}/metrics",
        response_model=MetricsPage,
        responses=responses("get_metrics"),
        dependencies=one_run,
    )
    async def get_metrics(
        run_id: RunId,
        store: Store,
        since: SinceId = None,
        limit: Annotated[int | None, Query(ge=1, le=100_000)] = None,
    ) -> MetricsPage:
        """The metrics time series, oldest first, after `since`."""
        await store.get(run_id)
        rows = await store.metrics(run_id, since_id=since, limit=limit)
        return MetricsPage(run_id=run_id, rows=rows, last_id=rows[-1]["_id"] if rows else since)

    @router.post(
        "/runs/{run_id}/stop",
        status_code=status.HTTP_202_ACCEPTED,
        response_model=RunRecord,
        responses=responses("stop"),
        dependencies=one_run,
    )
    async def stop(run_id: RunId, store: Store) -> RunRecord:
        """Ask the run to stop; 409 if it has already finished."""
        record = await store.request_stop(run_id)
        _REQUESTS.labels("stop").inc()
        if on_stop is not None:
            await on_stop(record)
        return record


async def visible_runs(
    store: RunStore, caller: Caller, limit: int, states: set[RunState] | None
) -> list[RunRecord]:
    """The runs `caller` may see, newest first: all for the operator, else its own run (if in `states`)."""
    if caller.run_id is None:
        return await store.list(limit=limit, states=states)
    try:
        record = await store.get(caller.run_id)
    except RunNotFound:
        return []
    return [record] if states is None or record.state in states else []


async def _call_hook(store: RunStore, record: RunRecord, hook: RunHook) -> None:
    """Runs `on_submit`; if it raises, the run is marked failed (never left pending) and the error
    propagates (500)."""
    try:
        await hook(record)
    except Exception as e:
        await store.set_state(record.run_id, RunState.FAILED, error=f"could not start: {e}")
        raise


def _summary(record: RunRecord) -> RunSummary:
    return RunSummary(
        run_id=record.run_id,
        name=record.name,
        state=record.state,
        step=record.step,
        policy_version=record.policy_version,
        created_at=record.created_at.isoformat(),
        updated_at=record.updated_at.isoformat(),
        error=record.error,
    )


async def run_status(store: RunStore, run_id: str, learner_stall_s: float = LEARNER_STALL_S) -> RunStatus:
    """The body of `GET /v1/runs/{id}` (health warnings by the run's own `health` thresholds)."""
    record = await store.get(run_id)
    rows = await store.recent_metrics(run_id, HEALTH_ROWS)
    health = run_health(rows, record.spec.health, limit=length_limit(record.spec))
    health += await liveness_warnings(store, record, learner_stall_s)
    warnings = record.warnings + [w for w in health if w not in record.warnings]
    return RunStatus(
        **record.model_dump(exclude={"warnings"}),
        warnings=warnings,
        counters=await store.counters(run_id),
        latest_metrics=rows[-1] if rows else None,
        scaling=await store.scaling(run_id),
        evaluation=evaluation_summary(rows),
    )


def public_routes() -> APIRouter:
    """Health, Prometheus metrics and the run page: no token needed."""
    router = APIRouter()

    unavailable = {"model": HealthBody, "description": "Redis does not answer"}

    @router.get(
        "/healthz",
        tags=["ops"],
        response_model=HealthBody,
        response_model_exclude_none=True,
        responses={503: unavailable, **responses("healthz")},
    )
    async def healthz(store: Store) -> JSONResponse:
        """200 when Redis answers, 503 otherwise (naming only the kind of error: no address)."""
        try:
            await store.redis.ping()  # type: ignore[misc]
        except Exception as e:  # deliberately tolerated: reported as unhealthy
            body = {"status": "unavailable", "redis": type(e).__name__}
            return JSONResponse(body, status.HTTP_503_SERVICE_UNAVAILABLE)
        return JSONResponse({"status": "ok"})

    @router.get(
        "/metrics",
        tags=["ops"],
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **responses("prometheus"),
        },
    )
    async def prometheus() -> Response:
        """Prometheus exposition."""
        body, content_type = metrics_response()
        return Response(body, media_type=content_type)

    @router.get("/runs/{run_id}", response_class=HTMLResponse, tags=["page"], responses=responses("run_page"))
    async def run_page(run_id: Annotated[str, Path(max_length=64)]) -> HTMLResponse:
        """The live page of a run (its data comes from /v1 with the token given as #token=...)."""
        return HTMLResponse(render_run_page(run_id))

    return router


def _error_handlers(app: FastAPI) -> None:
    """Store errors become 404 / 409; validation errors name the field."""

    async def not_found(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_404_NOT_FOUND)

    async def conflict(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status.HTTP_409_CONFLICT)

    app.add_exception_handler(RunNotFound, not_found)
    app.add_exception_handler(RunExists, conflict)
    app.add_exception_handler(InvalidTransition, conflict)
    app.add_exception_handler(RequestValidationError, validation_error)


def create_app(
    config: CoordinatorServiceConfig,
    redis: Redis | None = None,
    *,
    on_submit: RunHook | None = None,
    on_stop: RunHook | None = None,
    check: SpecCheck | None = None,
) -> FastAPI:
    """The coordinator's FastAPI app over `redis` (or a client for `config.redis.url`, owned and closed
    by the app's lifespan); `check` (e.g. `checks.SubmitCheck`) refuses runs that cannot run."""
    owned = redis is None
    client = redis or Redis.from_url(config.redis.url, socket_timeout=config.redis.socket_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if getattr(app.state, "prefs_builds", None) is not None:
            await app.state.prefs_builds.close()
        if owned:
            await client.aclose()

    app = FastAPI(title="rlfabric coordinator", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_docs(app)
    app.state.store = RunStore(client)
    roots = Roots.of(config.data_roots, config.model_roots)
    stall_s = config.checks.learner_stall_s
    app.include_router(run_routes(config.api.token, roots, on_submit, on_stop, check, stall_s))
    from rlfabric.coordinator.plan_api import add_plan_route  # it imports this module

    add_plan_route(app, config.api.token)
    from rlfabric.coordinator.fleet_api import add_fleet_route  # it imports this module

    add_fleet_route(app, config.api.token)
    if config.prefs.enabled:
        from rlfabric.coordinator.prefs_api import add_prefs_builds  # it imports this module

        add_prefs_builds(app, config, roots)
    app.include_router(public_routes())
    _error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.api.max_body_bytes)
    app.add_middleware(RequestSpans)
    app.add_middleware(RequestMetrics)  # outermost: counts what BodyLimit refuses too
    return app
