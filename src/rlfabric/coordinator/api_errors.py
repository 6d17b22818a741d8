"""What the coordinator's REST API answers when it refuses: the error bodies, every route's possible errors
for the OpenAPI document (`ROUTE_ERRORS`, `responses`), and the body-size limit (`BodyLimit`, 413)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ErrorBody(BaseModel):
    """Body of a 401, 403, 404, 409, 413 or 429: what went wrong, in words (never the content of a file)."""

    detail: str


class FieldError(BaseModel):
    """One invalid input of a 422."""

    loc: list[str | int]
    """Where: `body`, `query` or `path`, then the field's path, e.g. ["body", "dataset", "path"]."""
    msg: str
    """What is wrong with it."""
    type: str
    """Machine-readable kind, e.g. `int_type`, `less_than_equal`, `path_not_allowed`."""


class ValidationErrorBody(BaseModel):
    """Body of a 422: every offending input, and all of them in one line naming each by its dotted path."""

    detail: list[FieldError]
    message: str
    plan: dict[str, Any] | None = None
    """With a run refused for its `resources`: its memory plan (`rlfabric plan --json`'s schema)."""


ERROR_RESPONSES: dict[int, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token"},
    403: {"model": ErrorBody, "description": "A run's token on another run, or on an operator-only route"},
    404: {"model": ErrorBody, "description": "No run has this id"},
    409: {"model": ErrorBody, "description": "Conflict with the run's state or name"},
    413: {"model": ErrorBody, "description": "Request body over api.max_body_bytes"},
    422: {"model": ValidationErrorBody, "description": "Invalid input; each field named"},
    429: {"model": ErrorBody, "description": "Too many preference builds queued (prefs.max_queued)"},
}
"""Every error the API answers, with its body model."""

ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    "submit": (401, 403, 409, 413, 422),
    "list_runs": (401, 413, 422),
    "get_run": (401, 403, 404, 413, 422),
    "get_metrics": (401, 403, 404, 413, 422),
    "get_plan": (401, 403, 404, 413, 422),
    "get_fleet": (401, 403, 413, 422),
    "stop": (401, 403, 404, 409, 413, 422),
    "healthz": (413,),
    "prometheus": (413,),
    "run_page": (413, 422),
    "submit_prefs_build": (401, 403, 413, 422, 429),
    "list_prefs_builds": (401, 403, 413, 422),
    "get_prefs_build": (401, 403, 404, 413, 422),
}
"""The errors each route (by name) can answer: 413 from `BodyLimit` on every route, 401 on /v1, 403 where a
run's token may not go (`Caller`; the list of runs shows such a token its own run instead)."""
V1_ROUTES = frozenset(
    {"submit", "list_runs", "get_run", "get_metrics", "get_plan", "stop", "get_fleet"}
    | {"submit_prefs_build", "list_prefs_builds", "get_prefs_build"}
)
"""The routes under /v1 (JSON answers, bearer token)."""


def responses(route: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route: its errors from `ROUTE_ERRORS`. Errors are JSON even where the
    route answers another media type (FastAPI would document them in the route's), so the /v1 routes
    give the models and the others refer to them."""
    if route in V1_ROUTES:
        return {code: ERROR_RESPONSES[code] for code in ROUTE_ERRORS[route]}
    return {code: _json_error(code) for code in ROUTE_ERRORS[route]}


def _json_error(code: int) -> dict[str, Any]:
    """The error's entry, its body model given only as a JSON schema reference: the models are in the
    document's components because the /v1 routes name them."""
    model, description = ERROR_RESPONSES[code]["model"], ERROR_RESPONSES[code]["description"]
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes` (by Content-Length, or as it streams)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _too_large(self.max_bytes)(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, _too_large_text(self.max_bytes))
            return message

        return counted


def _too_large_text(max_bytes: int) -> str:
    return f"request body larger than {max_bytes} bytes"


def _too_large(max_bytes: int) -> JSONResponse:
    return JSONResponse({"detail": _too_large_text(max_bytes)}, status.HTTP_413_CONTENT_TOO_LARGE)
