"""Failpoints: named places where a test can make a process die, to prove what survives a crash.

    RLFABRIC_FAILPOINTS="learner.after_step=2,learner.before_ack=1"

makes the process SIGKILL itself the 2nd time it reaches `hit("learner.after_step")` (and the 1st time
it reaches `learner.before_ack`). `learner.after_step=3:hang` makes the calling thread block forever there
instead (a hung process, alive and making no progress). Unset (production), `hit` is a dictionary lookup
and nothing else. Only the fault-injection tests set the variable.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

ENV = "RLFABRIC_FAILPOINTS"


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
_SEEN: Counter[str] = Counter()


def hit(name: str) -> None:
    """SIGKILLs this process (or blocks the calling thread forever, for "hang") when `name` is armed and
    reached for the armed time."""
    if name not in _ARMED:
        return
    _SEEN[name] += 1
    nth, action = _ARMED[name]
    if _SEEN[name] != nth:
        return
    if action == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
