"""Failpoints: named places where a test can make a process die, to prove what survives a crash.

    RLFABRIC_FAILPOINTS="learner.after_step=2,learner.before_ack=1"

makes the process SIGKILL itself the 2nd time it reaches `hit("learner.after_step")` (and the 1st time
it reaches `learner.before_ack`). `learner.after_step=3:hang` makes the calling thread block forever there
instead (a hung process, alive and making no progress).

A failpoint is armed in every process that reads the variable, so a restarted process would die (or hang)
at the same place again. With `RLFABRIC_FAILPOINTS_FIRED=DIR`, each failpoint fires once among all the
processes that share DIR: the first to reach it writes `DIR/<name>` (atomically: of two replicas, one
fires) and acts; the rest, and its restarted self, pass. That is how a supervisor's recovery is tested
(`rlfabric up` restarts the hung learner, which then runs on).

Unset (production), `hit` is a dictionary lookup and nothing else. Only the fault-injection tests and
`bench/faults.py` set the variables.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

ENV = "RLFABRIC_FAILPOINTS"
FIRED_ENV = "RLFABRIC_FAILPOINTS_FIRED"


def _parse(spec: str) -> dict[str, tuple[int, str]]:
    """{name: (nth, action)}, the action "kill" or "hang"."""
    points = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, armed = item.partition("=")
        nth, _, action = armed.partition(":")
        if action not in ("", "kill", "hang"):
            raise ValueError(f"{ENV}: unknown action {action!r} in {item!r} (kill or hang)")
        points[name.strip()] = (int(nth or 1), action or "kill")
    return points


_ARMED = _parse(os.environ.get(ENV, ""))
_FIRED = os.environ.get(FIRED_ENV) or None
_SEEN: Counter[str] = Counter()


def hit(name: str) -> None:
    """SIGKILLs this process (or blocks the calling thread forever, for "hang") when `name` is armed and
    reached for the armed time (and, with `RLFABRIC_FAILPOINTS_FIRED`, has not fired before)."""
    if name not in _ARMED:
        return
    _SEEN[name] += 1
    nth, action = _ARMED[name]
    if _SEEN[name] != nth or not _first_to_fire(name, action):
        return
    if action == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def _first_to_fire(name: str, action: str) -> bool:
    """True without a fired folder; with one, True for the one process that claims `name` there."""
    if _FIRED is None:
        return True
    folder = Path(_FIRED)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as marker:  # when and where it fired: bench/faults.py times recovery from it
        marker.write(f"{time.time():.3f} {os.getpid()} {action}\n")
    return True


def fired_at(folder: Path, name: str) -> float | None:
    """When `name` fired (epoch seconds), from its marker in `folder`; None when it has not."""
    try:
        return float((folder / name).read_text().split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None
