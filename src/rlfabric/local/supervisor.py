"""Restarting the dead services of `rlfabric up`, with exponential backoff.

    poll (every second)   each watched process that exited is restarted after a delay, in its own thread:
                          it is launched again with the same argv (same port, replica id, config, data
                          directory), and is back once it prints its ready line again
    backoff               1, 2, 4 ... seconds (capped at `cap_s`) for the 1st, 2nd, 3rd ... death in a row
                          within `stable_s` of its start; a process that ran longer starts the count anew
    give up               after `max_fast_failures` such deaths in a row: `gave_up` says which and why,
                          and `up` fails the run
    finished              a process watched with `restart_clean_exit=False` (the learner) that exits with
                          code 0 has finished its work and is not restarted

A service resumes on its own when launched again: the learner from its checkpoint, a replica registers
under the same replica id and loads the run's current version, the coordinator picks its running runs up
from Redis, Redis replays its AOF. `close` ends supervision before `up` stops everything: no launch
happens after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlfabric.local.procs import ServiceProcess, ServiceStartError
from rlfabric.runtime.watchdog import EXIT_STALLED


@dataclass(frozen=True)
class Backoff:
    """How long to wait before a restart, and when to stop trying."""

    base_s: float = 1.0
    """The delay before the first restart of a streak; each further death in the streak doubles it."""
    cap_s: float = 30.0
    """The longest delay."""
    stable_s: float = 60.0
    """A process that ran this long before dying ends a streak: its restart waits `base_s` again."""
    max_fast_failures: int = 5
    """Deaths in a row, each within `stable_s` of its launch, after which the process is given up."""

    def delay(self, fast_failures: int) -> float:
        """The delay before the restart that follows `fast_failures` fast deaths in a row (0: a slow one)."""
        return min(self.cap_s, self.base_s * 2 ** max(fast_failures - 1, 0))


@dataclass
class Watched:
    """One supervised process and its restart history."""

    proc: ServiceProcess
    ready: str
    """The ready line's pattern, waited for after each restart."""
    restart_clean_exit: bool = True
    """False: an exit with code 0 means the work is done (not restarted)."""
    fast_failures: int = 0
    """Deaths in a row within `Backoff.stable_s` of their launch."""
    restarts: int = 0
    """Launches after the first."""
    hangs: int = 0
    """Of its deaths, those its watchdog caused (exit code `EXIT_STALLED`: it was alive and stuck)."""
    finished: bool = False
    restarting: threading.Thread | None = None

    def busy(self) -> bool:
        """A restart is under way (waiting out its delay, or waiting for the ready line)."""
        return self.restarting is not None and self.restarting.is_alive()


@dataclass
class Supervisor:
    """Restarts watched processes that die (see the module docstring)."""

    backoff: Backoff = field(default_factory=Backoff)
    start_timeout_s: float = 600.0
    """A restarted process that prints no ready line in this time is stopped (and counts as a death)."""
    say: Callable[[str], None] = print
    """Where the one-line restart messages go."""
    watched: list[Watched] = field(default_factory=list)
    gave_up: str | None = None
    """Why supervision failed (a process died too often in a row); None while it holds."""
    _closing: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def watch(self, proc: ServiceProcess, ready: str, *, restart_clean_exit: bool = True) -> None:
        """Supervises `proc`, which was started and is ready."""
        with self._lock:
            self.watched.append(Watched(proc, ready, restart_clean_exit))

    @property
    def closed(self) -> bool:
        """Supervision ended (`close`): the stack is being stopped."""
        return self._closing.is_set()

    def forget(self, proc: ServiceProcess) -> None:
        """Stops supervising `proc` (it is about to be stopped on purpose, e.g. scaled in)."""
        with self._lock:
            self.watched = [w for w in self.watched if w.proc is not proc]

    def alive(self, proc: ServiceProcess) -> bool:
        """`proc` runs, or is being restarted."""
        entry = next((w for w in self.watched if w.proc is proc), None)
        return proc.running() or (entry is not None and entry.busy())

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by process name (only those restarted)."""
        return {w.proc.name: w.restarts for w in self.watched if w.restarts}

    @property
    def hangs(self) -> dict[str, int]:
        """Deaths by the process's own watchdog so far (it hung), by process name (only those that did)."""
        return {w.proc.name: w.hangs for w in self.watched if w.hangs}

    def poll(self, now: float | None = None) -> None:
        """Schedules a restart for every watched process that died; sets `gave_up` when one died too
        often in a row."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._closing.is_set():
                return
            for entry in self.watched:
                if not (entry.finished or entry.busy() or entry.proc.running()):
                    self._died(entry, now)

    def _died(self, entry: Watched, now: float) -> None:
        proc, code = entry.proc, entry.proc.returncode
        proc.sweep()  # nothing of a dead process outlives it, even when its guard was the one killed
        if code == 0 and not entry.restart_clean_exit:
            entry.finished = True
            return
        uptime = now - proc.launched_at
        entry.hangs += code == EXIT_STALLED
        fast = uptime < self.backoff.stable_s
        entry.fast_failures = entry.fast_failures + 1 if fast else 0
        if entry.fast_failures >= self.backoff.max_fast_failures:
            entry.finished = True
            self.gave_up = (
                f"{proc.name} died {entry.fast_failures} times in a row, each within "
                f"{self.backoff.stable_s:.0f} s of its start (last exit code {code}); giving up "
                f"(its log: {proc.log_path})"
            )
            self.say(f"supervise: {self.gave_up}")
            return
        delay = self.backoff.delay(entry.fast_failures)
        entry.restarts += 1
        hung = f" (it hung: no progress for its stall_timeout_s; every stack is in {proc.log_path})"
        self.say(f"supervise: {proc.name} exited with code {code} after {uptime:.0f} s"
                 f"{hung if code == EXIT_STALLED else ''}; restarting in {delay:.0f} s "
                 f"(restart {entry.restarts})")  # fmt: skip
        entry.restarting = threading.Thread(target=self._restart, args=(entry, delay), daemon=True)
        entry.restarting.start()

    def _restart(self, entry: Watched, delay: float) -> None:
        """Waits out `delay`, launches the process again and waits for its ready line."""
        if self._closing.wait(delay):
            return
        with self._lock:
            if self._closing.is_set() or entry not in self.watched:
                return
            entry.proc.launch()
        try:
            entry.proc.wait_for(entry.ready, timeout_s=self.start_timeout_s)
        except ServiceStartError as exc:
            if not self._closing.is_set():
                self.say(f"supervise: {entry.proc.name} did not come back: {str(exc).splitlines()[0]}")
                entry.proc.stop(grace_s=10)
            return
        took = time.monotonic() - entry.proc.launched_at
        self.say(f"supervise: {entry.proc.name} is back (pid {entry.proc.service_pid}, {took:.0f} s)")

    def launch(self, proc: ServiceProcess) -> bool:
        """Launches `proc` unless supervision has ended (then the stack is being stopped, and a process
        launched now could outlive it); returns whether it launched."""
        with self._lock:
            if self._closing.is_set():
                return False
            proc.launch()
            return True

    def close(self) -> None:
        """Ends supervision: no restart is scheduled or launched after this returns."""
        with self._lock:
            self._closing.set()
