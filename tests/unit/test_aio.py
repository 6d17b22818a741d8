"""`rlfabric.runtime.aio.cancel_point`: a loop whose cancellation was swallowed once (as Python 3.11's
`asyncio.wait_for` can, inside redis-py) still ends at its next cancel point."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from rlfabric.runtime.aio import cancel_point


async def swallowing_loop(rounds: list[int], check: bool) -> None:
    while True:
        if check:
            cancel_point()
        rounds.append(1)
        with contextlib.suppress(asyncio.CancelledError):  # what a buggy library call does with it
            await asyncio.sleep(0.01)
        if len(rounds) > 50:
            return


async def test_a_swallowed_cancellation_still_ends_the_loop() -> None:
    rounds: list[int] = []
    task = asyncio.create_task(swallowing_loop(rounds, check=True))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(rounds) < 20


async def test_without_the_check_the_loop_runs_on() -> None:
    rounds: list[int] = []
    task = asyncio.create_task(swallowing_loop(rounds, check=False))
    await asyncio.sleep(0.05)
    task.cancel()
    await task  # returns normally: the cancellation was lost
    assert len(rounds) > 50


async def test_no_effect_outside_a_cancellation() -> None:
    cancel_point()  # a running, uncancelled task
    await asyncio.sleep(0)
