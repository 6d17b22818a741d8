"""Sessions: one environment instance per session id, with deadlines, limits and expiry.

Invariants:
1. at most `max_sessions` sessions are open; a Reset past it is `ResourceExhausted`;
2. every reset and step gets `step_timeout_s`: past it the answer is status "timeout" (a sync environment's
   worker thread cannot be killed and is left to finish; its session is over, so nothing reads it again);
3. an environment that raises, or answers the wrong type, is status "env_error", never a reward: the
   episode is over (`done`) and no further step is accepted;
4. the step that reaches `max_steps` without the environment ending the episode is status "truncated";
5. a session idle (no step) longer than its TTL is closed by `expire`; an unknown, closed or expired id is
   `NotFound` naming the session_id;
6. each outcome is counted (Prometheus): resets and steps by status, tool calls by outcome, expiries.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge

from rlfabric.environment.base import as_observation, as_step_result
from rlfabric.environment.loading import EnvironmentFactory
from rlfabric.environment.types import EnvStatus, ResetOutcome, StepOutcome, StepResult
from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger(__name__)

_RESETS = Counter("rlfabric_environment_resets_total", "Resets, by status", ["status"])
_STEPS = Counter("rlfabric_environment_steps_total", "Steps, by status", ["status"])
_TOOL_CALLS = Counter(
    "rlfabric_environment_tool_calls_total", "Tool calls, by outcome (ok, error)", ["outcome"]
)
_EXPIRED = Counter("rlfabric_environment_sessions_expired_total", "Sessions closed after their TTL")
_CLOSE_ERRORS = Counter("rlfabric_environment_close_errors_total", "Environments whose close() raised")
_OPEN = Gauge("rlfabric_environment_sessions_open", "Sessions open now")


@dataclass(frozen=True)
class SessionLimits:
    """What every session is held to (the service config's values)."""

    max_sessions: int = 1024
    session_ttl_s: float = 600.0
    step_timeout_s: float = 30.0
    max_steps: int = 64


@dataclass
class Session:
    """One open session: its environment and its bookkeeping."""

    env: Any
    ttl_s: float
    last_used: float
    steps: int = 0
    done: bool = False
    busy: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionTable:
    """The open sessions of one service process (see the module's invariants)."""

    def __init__(
        self,
        factory: EnvironmentFactory,
        limits: SessionLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factory = factory
        self.limits = limits
        self.clock = clock
        self.sessions: dict[str, Session] = {}

    async def reset(
        self, task: Mapping[str, Any], seed: int | None = None, ttl_s: float | None = None
    ) -> ResetOutcome:
        """Opens a session on `task`, or says why the environment could not start one."""
        ttl = self._ttl(ttl_s)
        if len(self.sessions) >= self.limits.max_sessions:
            raise ResourceExhausted(
                f"{len(self.sessions)} sessions are open, the limit (max_sessions); retry later"
            )
        env = self.factory()
        status, value, message = await self._call(lambda: env.reset(task, seed=seed), as_observation)
        _RESETS.labels(status).inc()
        if status != "ok":
            await self._close_env(env)
            return ResetOutcome(status, message=message)
        session_id = secrets.token_hex(16)
        self.sessions[session_id] = Session(env, ttl, self.clock())
        _OPEN.set(len(self.sessions))
        return ResetOutcome("ok", session_id, value)

    async def step(self, session_id: str, action: str) -> StepOutcome:
        """Applies `action` to the session; the outcome's status says how the environment answered."""
        session = self._get(session_id)
        if session.done:
            raise FailedPrecondition(f"session_id: session {session_id!r} is done; close it")
        if session.lock.locked():
            raise FailedPrecondition(f"session_id: session {session_id!r} is already running a step")
        async with session.lock:
            outcome = await self._step(session, action)
            session.last_used = self.clock()
        _STEPS.labels(outcome.status).inc()
        for record in outcome.result.tool_calls:
            _TOOL_CALLS.labels("ok" if record.ok else "error").inc()
        return outcome

    async def close(self, session_id: str) -> None:
        """Ends the session and closes its environment."""
        session = self._get(session_id)
        del self.sessions[session_id]
        _OPEN.set(len(self.sessions))
        await self._close_env(session.env)

    async def expire(self) -> list[str]:
        """Closes every idle session past its TTL; returns their ids."""
        now = self.clock()
        stale = [
            sid for sid, s in self.sessions.items() if not s.lock.locked() and now - s.last_used > s.ttl_s
        ]
        for session_id in stale:
            await self.close(session_id)
            _EXPIRED.inc()
        return stale

    async def run_expiry(self, interval_s: float) -> None:
        """`expire` every `interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.expire()

    async def _step(self, session: Session, action: str) -> StepOutcome:
        status, result, message = await self._call(lambda: session.env.step(action), as_step_result)
        session.steps += 1
        if status != "ok":
            session.done = True
            return StepOutcome.failed(status, message)
        session.done = result.done or session.steps >= self.limits.max_steps
        if result.truncated or (session.done and not result.done):
            done = StepResult(result.messages, result.reward, True, result.info, result.tool_calls, True)
            return StepOutcome(
                "truncated", done, f"the episode reached its step limit ({session.steps} steps)"
            )
        return StepOutcome("ok", result)

    async def _call(self, call: Callable[[], Any], check: Callable[[Any], Any]) -> tuple[EnvStatus, Any, str]:
        """Runs an environment method under the step deadline: ("ok", checked value, "") or the failure."""
        timeout = self.limits.step_timeout_s
        try:
            value = await asyncio.wait_for(_invoke(call), timeout)
            return "ok", check(value), ""
        except TimeoutError:
            return "timeout", None, f"the environment did not answer within {timeout:g} s (step_timeout_s)"
        except Exception as exc:
            log.warning("environment raised", exc_info=exc)
            return "env_error", None, f"the environment raised {type(exc).__name__}: {exc}"

    async def _close_env(self, env: Any) -> None:
        """Calls the environment's `close` when it has one; a failure is logged and counted, not raised
        (the session is gone either way)."""
        close = getattr(env, "close", None)
        if close is None:
            return
        try:
            await asyncio.wait_for(_invoke(close), self.limits.step_timeout_s)
        except Exception as exc:
            _CLOSE_ERRORS.inc()
            log.warning("environment close failed", exc_info=exc)

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: no session {session_id!r} (unknown, closed or expired)")
        return session

    def _ttl(self, requested: float | None) -> float:
        """The session's TTL: the server's, or a shorter one the caller asked for."""
        if requested is None:
            return self.limits.session_ttl_s
        if not 0 < requested <= self.limits.session_ttl_s:
            raise InvalidArgument(
                f"session_ttl_seconds: {requested:g} is not in (0, {self.limits.session_ttl_s:g}] "
                "(the server's session_ttl_s)"
            )
        return requested


async def _invoke(call: Callable[[], Any]) -> Any:
    """`call()` on a worker thread (a sync environment may block); the awaitable an async method returns
    is then awaited on the event loop."""
    value = await asyncio.to_thread(call)
    return await value if inspect.isawaitable(value) else value
