"""Learners sharing cores take turns (`learner.core_lock.core_turn`): one holder at a time, the wait
measured, no lock without a path, and a holder killed mid-step releases its turn."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from rlfabric.learner.core_lock import core_turn


def test_no_path_means_no_wait() -> None:
    with core_turn(None) as waited:
        assert waited == 0.0


def test_a_second_learner_waits_for_the_first_to_finish(tmp_path: Path) -> None:
    lock = tmp_path / "cores.lock"
    events: list[str] = []
    held = threading.Event()

    def first() -> None:
        with core_turn(lock):
            events.append("first in")
            held.set()
            time.sleep(0.3)
            events.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(5)
    with core_turn(lock) as waited:
        events.append("second in")
    thread.join()
    assert events == ["first in", "first out", "second in"]
    assert waited >= 0.2


def test_a_killed_holder_releases_the_turn(tmp_path: Path) -> None:
    lock = tmp_path / "cores.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom rlfabric.learner.core_lock import core_turn\n"
         f"with core_turn({str(lock)!r}):\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.kill()
        holder.wait(10)
        start = time.monotonic()
        with core_turn(lock):
            pass
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait(10)
