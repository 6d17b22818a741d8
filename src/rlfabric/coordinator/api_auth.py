"""Who may call the coordinator's REST API: the operator's token (`api.token`) or a run's own, compared in
constant time, as the `Caller` of a request; the FastAPI dependencies that admit them (`authenticate`,
`bearer_auth` for operator-only routes, `run_access` for one run's routes), and the path and store
parameters every /v1 route shares (`RunId`, `Store`)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rlfabric.coordinator.runs import RunStore, token_run_id
from rlfabric.runspec import RUN_NAME_PATTERN

RunId = Annotated[str, Path(pattern=RUN_NAME_PATTERN, description="The run's id (its name)")]


def _store(request: Request) -> RunStore:
    store: RunStore = request.app.state.store
    return store


Store = Annotated[RunStore, Depends(_store)]


_BEARER = HTTPBearer(
    auto_error=False, description="The coordinator's api.token, or a run's own token (`run_token`)"
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
ANOTHER_RUN = "this token belongs to another run"
"""The 403 of a run's token on another run's route."""
OPERATOR_ONLY = "this route needs the operator's token (api.token); a run's token cannot use it"
"""The 403 of a run's token where only the operator's may go (submitting runs, preference builds)."""


@dataclass(frozen=True)
class Caller:
    """Who sent a /v1 request: the operator (`run_id` None; also everyone when no `api.token` is set), or
    the holder of one run's token."""

    run_id: str | None = None
    """The run whose token was presented; None for the operator."""

    def check_run(self, run_id: str) -> None:
        """403 unless the caller may act on `run_id` (whether or not that run exists)."""
        if self.run_id is not None and self.run_id != run_id:
            raise HTTPException(status.HTTP_403_FORBIDDEN, ANOTHER_RUN)

    def check_operator(self) -> None:
        """403 unless the caller is the operator."""
        if self.run_id is not None:
            raise HTTPException(status.HTTP_403_FORBIDDEN, OPERATOR_ONLY)


OPERATOR = Caller()


def _unauthorized() -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
    )


@cache
def authenticate(token: str | None) -> Callable[..., Awaitable[Caller]]:
    """A dependency naming the `Caller`: everyone is the operator when `token` is None; else the operator's
    token or a run's own (both compared in constant time), 401 for anything else. One callable per token,
    so FastAPI resolves it once per request however many dependencies name it. Those that name it give it
    as a parameter's default (`= Depends(...)`, hence B008): an `Annotated` type naming a closure's
    variable does not resolve under postponed annotations."""

    async def caller(credentials: Credentials, store: Store) -> Caller:
        if token is None:
            return OPERATOR
        given = credentials.credentials if credentials else ""
        if hmac.compare_digest(given.encode(), token.encode()):
            return OPERATOR
        run_id = token_run_id(given)
        if run_id is not None and await store.token_matches(run_id, given):
            return Caller(run_id)
        raise _unauthorized()

    return caller


@cache
def bearer_auth(token: str | None) -> Callable[..., Awaitable[None]]:
    """A dependency for operator-only routes: any request when `token` is None, else only the operator's
    token (401 for a wrong one, 403 for a run's own)."""

    async def check(caller: Caller = Depends(authenticate(token))) -> None:  # noqa: B008
        caller.check_operator()

    return check


@cache
def run_access(token: str | None) -> Callable[..., Awaitable[None]]:
    """A dependency for the routes of one run (`{run_id}` in the path): the operator, or that run's token
    (403 for another run's)."""

    async def check(run_id: RunId, caller: Caller = Depends(authenticate(token))) -> None:  # noqa: B008
        caller.check_run(run_id)

    return check
