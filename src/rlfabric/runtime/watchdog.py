"""A progress watchdog: ends a process that is alive but no longer makes progress, so that whoever started
it restarts it.

A dead process is restarted by its supervisor (`rlfabric up`, Kubernetes, torchrun); a hung one (a lost
wake-up, a deadlock in native code, an `await` on a connection that will never answer) is not, and a run
whose learner hangs waits forever (a hung replica holds its requests until the coordinator's deadline,
then gets new ones). The owner calls `tick()` wherever its work moves on; a thread checks that a tick came
within `timeout_s` while there is work (`busy`: a replica with nothing in flight is idle, not stalled).
When none did, it logs what it last saw, writes every thread's stack and the event loop's asyncio tasks to
stderr (where the hang is), and ends the process at once with `EXIT_STALLED`. Exiting abruptly is what a
crash does, and recovery from a crash at any point is proven (tests/faults): a learner resumes from its
last complete checkpoint, a replica's requests go elsewhere, and the books balance.

The watchdog's thread needs the GIL to run. Native code that hangs while holding it (a C extension's
deadlock) would starve the thread as well, so while it runs the thread keeps a C-level timer armed
(`faulthandler.dump_traceback_later`, re-armed at each check, cancelled when the watchdog stops): when
the thread itself cannot run for `BACKSTOP_FACTOR` x `timeout_s`, the timer writes every thread's stack
after a "Timeout" line and ends the process with code 1. It is armed only by watchdogs that end the
process (`exit` is `os._exit`), and there is one such timer per process: the last check to re-arm it sets
it.

torch's NCCL watchdog does the same for a collective that never completes; this one covers the rest.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from rlfabric.runtime.logs import asyncio_task_stacks

log = logging.getLogger(__name__)

EXIT_STALLED = 75
"""The exit code of a process the watchdog ended (EX_TEMPFAIL: a temporary failure, worth a restart)."""
BACKSTOP_FACTOR = 2.0
"""The C-level timer ends the process when the watchdog's own thread could not run for this many
timeouts (the GIL held by hung native code)."""
_FIRING = threading.Lock()
"""Held by the watchdog that reports and ends the process; another one that fires meanwhile waits."""


class Watchdog:
    """Ends the process when `tick()` was not called for `timeout_s` seconds (see the module docstring)."""

    def __init__(
        self,
        timeout_s: float,
        what: str,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        busy: Callable[[], bool] | None = None,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.timeout_s = timeout_s
        self.what = what
        """What makes no progress, for the message ("the learner's training loop")."""
        self.loop = loop
        """The event loop whose tasks' stacks are written too (None: threads only)."""
        self.busy = busy
        """Whether there is work to make progress on (None: always): time without work is not a stall."""
        self._exit = exit
        self._last = time.monotonic()
        self._where = "start"
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.heartbeat: asyncio.Task[None] | None = None
        """The task that ticks it from an event loop (`watch_event_loop`), kept referenced."""

    def tick(self, where: str) -> None:
        """Progress: the work moved on; `where` names the last place it did, for the message."""
        self._last, self._where = time.monotonic(), where

    def start(self) -> Watchdog:
        self.tick("start")
        self._thread = threading.Thread(target=self._watch, name="rlfabric-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        backstop = self._exit is os._exit and self.timeout_s != float("inf")
        try:
            while not self._stopped.wait(min(5.0, self.timeout_s / 10)):
                if backstop:  # this thread ran: push the C-level timer on
                    faulthandler.dump_traceback_later(BACKSTOP_FACTOR * self.timeout_s, exit=True)
                if self.busy is not None and not self.busy():
                    self.tick("idle")
                    continue
                idle = time.monotonic() - self._last
                if idle >= self.timeout_s:
                    self._fire(idle)
                    return
        finally:
            if backstop:
                faulthandler.cancel_dump_traceback_later()

    def _fire(self, idle: float) -> None:
        with _FIRING:  # one report at a time: a second watchdog of the process waits for the exit
            self._report_and_exit(idle)

    def _report_and_exit(self, idle: float) -> None:
        log.error(
            "%s made no progress for %.0f s (the last was: %s): writing every stack and exiting with code %d "
            "so that its supervisor restarts it", self.what, idle, self._where, EXIT_STALLED,
        )  # fmt: skip
        sys.stderr.flush()
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback(all_threads=True)
        if self.loop is not None:
            print(asyncio_task_stacks(self.loop), file=sys.stderr, flush=True)
        self._exit(EXIT_STALLED)


async def watch_event_loop(
    timeout_s: float | None,
    what: str,
    *,
    busy: Callable[[], bool] | None = None,
    exit: Callable[[int], object] = os._exit,
) -> Watchdog | None:
    """Arms a watchdog on the running event loop: a task ticks it every second, so only a loop that stops
    turning (a blocking call in a coroutine that never returns: every request and every run of the service
    waits behind it) goes `timeout_s` without a tick; `busy` as for `Watchdog` (None: always watched). None
    (and nothing armed) when `timeout_s` is None.
    The heartbeat task lives as long as the loop; the caller keeps the watchdog to `stop()` it."""
    if timeout_s is None:
        return None
    loop = asyncio.get_running_loop()
    watchdog = Watchdog(timeout_s, what, loop=loop, busy=busy, exit=exit).start()

    async def heartbeat() -> None:
        while True:
            watchdog.tick("the event loop turned")
            await asyncio.sleep(min(1.0, timeout_s / 10))

    watchdog.heartbeat = loop.create_task(heartbeat(), name="rlfabric-watchdog-heartbeat")
    return watchdog
