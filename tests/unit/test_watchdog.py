"""`runtime.watchdog.Watchdog` with a real thread: ticks keep a process alive, their absence ends it with
EXIT_STALLED after writing every thread's stack and the event loop's tasks (the exit is captured here; the
learner's real exit and restart are in tests/faults/test_kills.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlfabric.runtime import failpoints
from rlfabric.runtime.watchdog import EXIT_STALLED, Watchdog


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def test_ticks_keep_it_quiet_and_their_absence_ends_the_process(capfd: pytest.CaptureFixture[str]) -> None:
    exits = Exits()
    watchdog = Watchdog(0.5, "the test's loop", exit=exits).start()
    try:
        for i in range(15):  # 1.5 s of work, three timeouts long, ticking every 0.1 s
            watchdog.tick(f"item {i}")
            time.sleep(0.1)
        assert exits.codes == []
        assert exits.called.wait(5), "no tick for 5 s and the watchdog did not fire"
    finally:
        watchdog.stop()
    assert exits.codes == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert "Thread 0x" in err and "test_watchdog.py" in err  # every thread's stack, this test's among them


def test_it_writes_where_each_asyncio_task_waits(capfd: pytest.CaptureFixture[str]) -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()  # an await that never completes, as a hang does

    async def main() -> list[int]:
        exits = Exits()
        watchdog = Watchdog(0.3, "the test's loop", loop=asyncio.get_running_loop(), exit=exits).start()
        task = asyncio.create_task(stuck(), name="the-stuck-one")
        while not exits.called.is_set():
            await asyncio.sleep(0.05)
        watchdog.stop()
        task.cancel()
        return exits.codes

    assert asyncio.run(main()) == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert "Task the-stuck-one" in err
    assert "in stuck" in err and "in wait" in err  # down the awaits: stuck() awaits Event.wait()


def test_a_stopped_watchdog_never_fires() -> None:
    exits = Exits()
    Watchdog(0.2, "the test's loop", exit=exits).start().stop()
    time.sleep(0.5)
    assert exits.codes == []


def test_failpoints_parse_kill_and_hang() -> None:
    assert failpoints._parse("a.b=2, c.d=1:hang,e") == {
        "a.b": (2, "kill"),
        "c.d": (1, "hang"),
        "e": (1, "kill"),
    }
    with pytest.raises(ValueError, match="unknown action 'sleep'"):
        failpoints._parse("a.b=1:sleep")
