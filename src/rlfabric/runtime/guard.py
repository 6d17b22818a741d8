"""A process guard: runs one service and makes sure nothing it started outlives it or its parent.

    python -m rlfabric.runtime.guard [--grace S] [--cpus LIST] -- ARGV...

`rlfabric up` launches every service through a guard, because killing a service's PID alone leaves its
helpers behind (a vLLM replica's EngineCore and multiprocessing resource tracker were found orphaned under
PID 1 after `kill -9` of the replica), and a killed `up` left every service running.

Invariants:

1. The guard is a child subreaper (Linux): a descendant of the service whose own parent dies is
   re-parented to the guard, not to PID 1, so the guard can always find it (even one in a new session).
2. When the service exits, for whatever reason, the guard SIGKILLs every remaining descendant, reaps them,
   and exits with the service's status (128 + N for a death by signal N, as a shell reports it).
3. When the guard's parent disappears (exit, crash or SIGKILL: the guard is re-parented), the guard sends
   SIGTERM to the service, waits up to `--grace` seconds, then does 2.
4. SIGTERM and SIGINT to the guard are forwarded to the service (a graceful stop); 2 follows its exit.
   SIGUSR1 is forwarded too (a service's stack dump, `runtime.logs.enable_stack_dumps`).
5. If the guard itself is SIGKILLed, the service gets SIGKILL too (PR_SET_PDEATHSIG); whoever kills a
   guard should kill its process group, which the guard leads (`ServiceProcess.kill` does).

With `--cpus` ("1", "0-3", "0,2") the guard confines itself to those cores before it starts the service, so
the service and everything it starts inherit the set (`rlfabric up --learner-cores`).

The guard's first output line is `rlfabric-guard: service pid N`; the service's own output follows on the
same stdout/stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.1
"""How often the guard looks at its parent and its service."""
PID_LINE = "rlfabric-guard: service pid"
"""The guard's first output line, followed by the service's PID."""


def prctl(option: int, value: int) -> bool:
    """prctl(2) through libc; False where it is unavailable (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, value, 0, 0, 0)) == 0


def spawn(argv: Sequence[str]) -> tuple[int, int]:
    """Forks the service; it dies with SIGKILL when the guard dies (invariant 5). Returns its PID and a
    descriptor to close once its PID is announced: the child execs only then, so the PID line comes
    first in the output."""
    guard = os.getpid()
    gate, release = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the exec, or exit 127 as a shell would
        try:
            os.close(release)
            os.read(gate, 1)  # b"" once the guard closed `release`
            os.close(gate)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != guard:
                os._exit(137)
            os.execvp(argv[0], list(argv))
        except BaseException:
            os._exit(127)
    os.close(gate)
    return pid, release


def descendants(root: int) -> list[int]:
    """PIDs of every live process below `root`, read from /proc (children first found, then theirs)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                ppid = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        parents.setdefault(ppid, []).append(int(entry))
    found, frontier = [], [root]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def reap_all() -> dict[int, int]:
    """Reaps every exited child without blocking; returns pid -> wait status of those reaped."""
    reaped: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped[pid] = status


def kill_descendants(timeout_s: float = 10.0) -> dict[int, int]:
    """SIGKILLs and reaps everything below the guard until nothing is left (or `timeout_s` passed);
    returns pid -> wait status of the children it reaped (the service's among them, if it was one)."""
    deadline = time.monotonic() + timeout_s
    reaped: dict[int, int] = {}
    while (left := descendants(os.getpid())) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
        reaped.update(reap_all())
    return reaped


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal number."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Guard:
    """The guard's state: the service, the parent it started under, and the signals it was sent."""

    def __init__(self, argv: Sequence[str], grace_s: float) -> None:
        self.parent = os.getppid()
        self.grace_s = grace_s
        self.pending: list[int] = []
        self.term_deadline: float | None = None
        self.status: int | None = None
        """The service's wait status once it was reaped."""
        self.child, self.release = spawn(argv)

    def on_signal(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def run(self) -> int:
        """Waits for the service's exit (invariants 3 and 4 on the way), then clears up (invariant 2)."""
        while True:
            self.note(reap_all())
            if self.status is not None:
                kill_descendants()
                return exit_code(self.status)
            self.forward_signals()
            self.watch_parent()
            time.sleep(POLL_S)

    def note(self, reaped: dict[int, int]) -> None:
        """Keeps the service's wait status if it is among the `reaped`."""
        if self.child in reaped:
            self.status = reaped[self.child]

    def forward_signals(self) -> None:
        while self.pending:
            self.send(self.pending.pop(0))

    def watch_parent(self) -> None:
        """Invariant 3: SIGTERM once the parent is gone, SIGKILL of the whole tree past the grace."""
        if os.getppid() == self.parent:
            return
        now = time.monotonic()
        if self.term_deadline is None:
            self.term_deadline = now + self.grace_s
            self.send(signal.SIGTERM)
        elif now >= self.term_deadline:
            self.note(kill_descendants())

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child, signum)


def cpu_list(text: str) -> set[int]:
    """`--cpus`: core numbers and ranges, comma-separated ("1", "0-3,6")."""
    cores: set[int] = set()
    for chunk in text.split(","):
        bounds = chunk.strip().split("-")
        if len(bounds) > 2 or not all(b.isdigit() for b in bounds) or int(bounds[0]) > int(bounds[-1]):
            raise argparse.ArgumentTypeError(f"expected cores like 1 or 0-3,6, got {text!r}")
        cores.update(range(int(bounds[0]), int(bounds[-1]) + 1))
    return cores


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfabric.runtime.guard", description=__doc__)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL (5)")
    parser.add_argument("--cpus", type=cpu_list, help="run the service on these cores only (e.g. 1 or 0-3,6)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the service's argv")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to guard")
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    guard = Guard(command, args.grace)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, guard.on_signal)
    print(f"{PID_LINE} {guard.child}", flush=True)
    os.close(guard.release)
    return guard.run()


if __name__ == "__main__":
    sys.exit(main())
