"""Failpoints: named places where a test can make a process die, to prove what survives a crash.

    RLFABRIC_FAILPOINTS="learner.after_step=2,learner.before_ack=1"

makes the process SIGKILL itself the 2nd time it reaches `hit("learner.after_step")` (and the 1st time
it reaches `learner.before_ack`). Unset (production), `hit` is a dictionary lookup and nothing else.
Only the fault-injection tests set the variable.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "RLFABRIC_FAILPOINTS"


def _parse(spec: str) -> dict[str, int]:
    points = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition("=")
        points[name.strip()] = int(nth or 1)
    return points


_ARMED = _parse(os.environ.get(ENV, ""))
_SEEN: Counter[str] = Counter()


def hit(name: str) -> None:
    """SIGKILLs this process when `name` is armed and reached for the armed time."""
    if name not in _ARMED:
        return
    _SEEN[name] += 1
    if _SEEN[name] == _ARMED[name]:
        os.kill(os.getpid(), signal.SIGKILL)
