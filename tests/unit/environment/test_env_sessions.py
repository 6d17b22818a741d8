"""`SessionTable`: ids, the session limit, per-step deadlines (TIMEOUT), environment faults (ENV_ERROR),
truncation, NOT_FOUND naming the session, and expiry after the TTL (a fake clock)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rlfabric.environment.sessions import SessionLimits, SessionTable
from rlfabric.environment.types import Observation, StepResult
from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted


class Scripted:
    """Answers each action by what it says: "sleep" blocks (sync), "asleep" awaits, "raise" raises,
    "end" ends the episode, "bad" returns a non-result; anything else is echoed."""

    closed: list[Scripted] = []

    def reset(self, task: dict[str, Any], *, seed: int | None = None) -> Observation:
        if task.get("fail"):
            raise RuntimeError("bad task")
        return Observation([{"role": "user", "content": str(task.get("prompt", ""))}])

    def step(self, action: str) -> Any:
        if action == "sleep":
            time.sleep(1.0)
        if action == "raise":
            raise ValueError("broken")
        if action == "bad":
            return "not a result"
        if action == "asleep":
            return self._asleep()
        return StepResult([{"role": "user", "content": action}], done=action == "end")

    async def _asleep(self) -> StepResult:
        await asyncio.sleep(10)
        return StepResult([])

    def close(self) -> None:
        Scripted.closed.append(self)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock | None = None, **limits: Any) -> SessionTable:
    settings = {"max_sessions": 2, "session_ttl_s": 60.0, "step_timeout_s": 0.3, "max_steps": 3, **limits}
    return SessionTable(Scripted, SessionLimits(**settings), clock=clock or time.monotonic)


async def test_sessions_step_and_close_and_unknown_ids_are_not_found() -> None:
    sessions = table()
    opened = await sessions.reset({"prompt": "hi"})
    assert opened.status == "ok" and len(opened.session_id) == 32
    assert opened.observation.messages == [{"role": "user", "content": "hi"}]
    step = await sessions.step(opened.session_id, "x")
    assert step.status == "ok" and step.result.messages[0]["content"] == "x"
    await sessions.close(opened.session_id)
    for call in (sessions.step(opened.session_id, "x"), sessions.close(opened.session_id)):
        with pytest.raises(NotFound, match=f"session_id: no session '{opened.session_id}'"):
            await call


async def test_the_session_limit_is_resource_exhausted() -> None:
    sessions = table()
    await sessions.reset({})
    await sessions.reset({})
    with pytest.raises(ResourceExhausted, match="max_sessions"):
        await sessions.reset({})


@pytest.mark.parametrize(
    ("action", "status", "reason"),
    [
        ("sleep", "timeout", "within 0.3 s"),
        ("asleep", "timeout", "within 0.3 s"),
        ("raise", "env_error", "raised ValueError: broken"),
        ("bad", "env_error", "not a StepResult"),
    ],
)
async def test_faults_and_timeouts_are_statuses_that_end_the_episode(
    action: str, status: str, reason: str
) -> None:
    sessions = table()
    session_id = (await sessions.reset({})).session_id
    outcome = await sessions.step(session_id, action)
    assert (outcome.status, outcome.result.done, outcome.result.reward) == (status, True, None)
    assert reason in outcome.message
    with pytest.raises(FailedPrecondition, match="is done"):
        await sessions.step(session_id, "x")


async def test_a_failing_reset_opens_no_session() -> None:
    sessions = table()
    outcome = await sessions.reset({"fail": True})
    assert (outcome.status, outcome.session_id) == ("env_error", "")
    assert "bad task" in outcome.message and sessions.sessions == {}


async def test_the_step_limit_truncates() -> None:
    sessions = table()
    session_id = (await sessions.reset({})).session_id
    assert [(await sessions.step(session_id, "x")).status for _ in range(2)] == ["ok", "ok"]
    last = await sessions.step(session_id, "x")
    assert (last.status, last.result.done, last.result.truncated) == ("truncated", True, True)
    assert last.result.messages == [{"role": "user", "content": "x"}]


async def test_idle_sessions_expire_after_their_ttl_and_a_longer_ttl_is_refused() -> None:
    clock = Clock()
    sessions = table(clock)
    short = (await sessions.reset({}, ttl_s=10)).session_id
    long = (await sessions.reset({})).session_id
    clock.now = 30
    Scripted.closed.clear()
    assert await sessions.expire() == [short]
    assert len(Scripted.closed) == 1
    await sessions.step(long, "x")
    clock.now = 85
    assert await sessions.expire() == []
    clock.now = 91
    assert await sessions.expire() == [long]
    with pytest.raises(InvalidArgument, match="session_ttl_seconds"):
        await sessions.reset({}, ttl_s=61)
