"""Starting service processes and knowing when they are ready: used by `rlfabric up` and the tests.

A service announces readiness by printing a line (e.g. "rlfabric reward service listening on
127.0.0.1:40123"); `ServiceProcess.start` waits for a line matching a pattern and returns the match, so a
caller learns the ephemeral port the service bound. Output keeps draining to a log file afterwards, so a
chatty process never blocks on a full pipe. `stop` sends SIGTERM to the process (by PID, never by name),
waits for its graceful shutdown, and SIGKILLs it only past the grace period.

With `guarded=True` the process runs under `rlfabric.runtime.guard`, which kills everything the service
started when the service exits and everything when the guard's parent (this process) disappears, even by
SIGKILL; `pid` is then the guard's and `service_pid` the service's own. A process may be launched again
after it exited (a restart): the same log file continues, the ready-line wait starts afresh.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from rlfabric.runtime.guard import PID_LINE


class ServiceStartError(RuntimeError):
    """The process exited or stayed silent before printing its ready line; the message has its output."""


class ServiceProcess:
    """One child process with its output captured to `log_path` (and the last lines kept in memory)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        guarded: bool = False,
        guard_grace_s: float = 5.0,
        cpus: str | None = None,
    ) -> None:
        assert guarded or cpus is None, "cores are set by the guard"
        self.name = name
        self.argv = list(argv)
        self.guarded = guarded
        """Run under `rlfabric.runtime.guard` (see the module docstring)."""
        self.guard_grace_s = guard_grace_s
        """The guard's grace from SIGTERM to SIGKILL once this process's parent is gone."""
        self.cpus = cpus
        """The cores the guard confines the service to ("1", "0-3"; guarded only), None for any."""
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=200)
        self._lines: deque[str] = deque()
        self._new_line = threading.Condition()
        self._drain: threading.Thread | None = None
        self._service_pid: int | None = None
        self.launched_at = 0.0
        """time.monotonic() of the latest launch."""

    @property
    def pid(self) -> int:
        """The PID of the launched process (the guard's when guarded)."""
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def service_pid(self) -> int | None:
        """The service's own PID: `pid` unless guarded; under a guard, None until the guard announced it."""
        return self._service_pid if self.guarded else (self.proc.pid if self.proc else None)

    @property
    def returncode(self) -> int | None:
        """The exit code once the latest launch exited (a guard reports 128 + N for a death by signal N)."""
        return self.proc.poll() if self.proc is not None else None

    def command(self) -> list[str]:
        """The argv actually executed: the service's, behind the guard when guarded."""
        if not self.guarded:
            return self.argv
        guard = [sys.executable, "-m", "rlfabric.runtime.guard", "--grace", str(self.guard_grace_s)]
        if self.cpus:
            guard += ["--cpus", self.cpus]
        return [*guard, "--", *self.argv]

    def start(self, ready: str | re.Pattern[str], timeout_s: float = 120.0) -> re.Match[str]:
        """Starts the process and waits until a line matches `ready`; returns that match."""
        self.launch()
        return self.wait_for(ready, timeout_s)

    def launch(self) -> None:
        """Starts the process without waiting for it (`wait_for` its ready line later). A process that
        exited may be launched again."""
        assert not self.running(), f"{self.name} is running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._new_line:
            self._lines.clear()
            self._service_pid = None
        self.launched_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._drain = threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True)
        self._drain.start()

    def _pump(self, stream: IO[str]) -> None:
        with self.log_path.open("a") as log:
            for line in stream:
                log.write(line)
                log.flush()
                with self._new_line:
                    if self.guarded and self._service_pid is None and line.startswith(PID_LINE):
                        self._service_pid = int(line[len(PID_LINE) :])
                    self.tail.append(line.rstrip("\n"))
                    self._lines.append(line)
                    self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    def wait_for(self, ready: str | re.Pattern[str], timeout_s: float = 120.0) -> re.Match[str]:
        """Waits for the next output line matching `ready` (lines seen by an earlier wait are consumed)."""
        pattern = re.compile(ready) if isinstance(ready, str) else ready
        deadline = time.monotonic() + timeout_s
        with self._new_line:
            while True:
                while self._lines:
                    match = pattern.search(self._lines.popleft())
                    if match:
                        return match
                if not self.running() and not (self._drain and self._drain.is_alive()):
                    code = self.proc.returncode if self.proc else None
                    raise ServiceStartError(self._failure(f"exited with code {code}"))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServiceStartError(self._failure("printed no ready line in time"))
                self._new_line.wait(min(remaining, 0.5))

    def _failure(self, what: str) -> str:
        output = "\n".join(list(self.tail)[-40:])
        return f"{self.name} {what}; its last output ({self.log_path}):\n{output}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.wait()
        if self._drain is not None:
            self._drain.join(5)
        return self.proc.returncode

    def sweep(self) -> None:
        """After the process died: SIGKILL whatever is left of its process group. A guard SIGKILLed takes
        its service along (PDEATHSIG), but the service's own children (a replica's vLLM engine core and
        worker) are then re-parented to PID 1, still in the group the guard led."""
        if self.proc is None or self.proc.poll() is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the process and everything in its session (engine workers it spawned)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
