"""Learners that share cores train one at a time.

Several learners pinned to the same cores (`rlfabric up RUN ... RUN --learner-cores ...`: LoRA runs on one
fleet) otherwise train at once and the kernel time-slices them: every step stretches to the sum of the
steps in progress, all of them end late together, and their runs (on-policy) wait to generate while the
shared replica idles. Taking turns, each step takes what it takes alone and its run goes back to
generating at once, staggered with the others. Measured on 2 cores (`bench/lora_fleet.py --placement
split`), four learners on one core: see bench/README.md.

The turn is an exclusive `flock` on a file the learners share (`LearnerServiceConfig.compute_lock`), held
for the training part of a step only (not the publish). An uncontended lock costs microseconds; the lock
goes with the process that holds it, so a learner killed mid-step never blocks the others. In a learner
of several ranks only rank 0 takes it: the other ranks wait for rank 0 at their first collective.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def core_turn(path: str | Path | None) -> Iterator[float]:
    """Holds the exclusive lock on `path` for the block and yields the seconds spent waiting for it;
    without a path, yields 0.0 at once."""
    if path is None:
        yield 0.0
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        start = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield time.perf_counter() - start
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
