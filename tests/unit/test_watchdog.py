"""`runtime.watchdog.Watchdog` with a real thread: ticks keep a process alive, their absence ends it with
EXIT_STALLED after writing every thread's stack and the event loop's tasks (the exit is captured here; the
learner's real exit and restart are in tests/faults/test_kills.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlfabric.runtime import failpoints
from rlfabric.runtime.watchdog import EXIT_STALLED, Watchdog, watch_event_loop


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


def test_an_event_loop_that_stops_turning_is_ended_and_a_busy_one_is_not(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`watch_event_loop`: a loop awaiting for three timeouts is quiet; a coroutine blocking it (a sync
    sleep standing in for a call that never returns) ends the process, with that coroutine's frame in the
    threads' stacks."""

    async def main() -> tuple[list[int], list[int]]:
        exits = Exits()
        watchdog = await watch_event_loop(0.4, "the test's event loop", exit=exits)
        assert watchdog is not None and await watch_event_loop(None, "nothing") is None
        await asyncio.sleep(1.2)  # awaits: the loop turns, the heartbeat ticks
        quiet = list(exits.codes)
        time.sleep(1.5)  # the blocked loop under test
        watchdog.stop()
        return quiet, exits.codes

    quiet, codes = asyncio.run(main())
    assert quiet == [] and codes == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert "in main" in err  # the blocking coroutine's frame
    assert "the test's event loop made no progress" in caplog.text


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


def test_a_failpoint_with_a_fired_folder_fires_once_among_processes(tmp_path: Path) -> None:
    """The first process to reach it is killed and leaves its marker; the next (its restarted self, or
    another process sharing the folder) passes it. Without the folder, each process dies there."""
    code = "from rlfabric.runtime import failpoints; failpoints.hit('x.y'); print('passed')"
    fired = tmp_path / "fired"

    def reach(**extra: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, failpoints.ENV: "x.y=1", **extra}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    first = reach(**{failpoints.FIRED_ENV: str(fired)})
    assert first.returncode == -signal.SIGKILL, first
    stamp, pid, action = (fired / "x.y").read_text().split()
    assert action == "kill" and int(pid) > 0
    assert failpoints.fired_at(fired, "x.y") == float(stamp) and failpoints.fired_at(fired, "a.b") is None
    again = reach(**{failpoints.FIRED_ENV: str(fired)})
    assert again.returncode == 0 and again.stdout == "passed\n", again
    assert reach().returncode == -signal.SIGKILL  # no folder: armed in every process


def test_native_code_holding_the_gil_is_ended_by_the_c_level_backstop() -> None:
    """A real process whose main thread hangs inside native code holding the GIL (a regular expression
    that backtracks for ever stands in for a C extension's deadlock): the watchdog's own thread cannot run,
    so the C-level timer it armed writes the stacks and ends the process, after 2 x its 1 s timeout."""
    code = (
        "import re, time\n"
        "from rlfabric.runtime.watchdog import Watchdog\n"
        "Watchdog(1.0, 'the test work').start()\n"
        "time.sleep(0.5)\n"
        "re.match(r'(a+)+$', 'a' * 40 + 'b')  # holds the GIL far longer than the test\n"
        "print('not reached')\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "not reached" not in done.stdout, done
    assert "Timeout (0:00:02)!" in done.stderr and "in match" in done.stderr, done.stderr
    assert time.monotonic() - started < 30
