"""`rlfabric.local.handoff` with real guarded processes: a ready twin is supervised and counted in place of
the eager replica, which is stopped; a twin that does not start leaves the eager replica serving."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from rlfabric.local.handoff import Handoff
from rlfabric.local.procs import ServiceProcess
from rlfabric.local.scaler import LocalScaler, ScalePolicy
from rlfabric.local.supervisor import Backoff, Supervisor


def process(tmp_path: Path, name: str, code: str) -> ServiceProcess:
    argv = [sys.executable, "-c", code]
    return ServiceProcess(name, argv, log_path=tmp_path / f"{name}.log", guarded=True)


def until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


SERVE = "import time; print('ready', flush=True); time.sleep(120)"


def eager_and_twin(
    tmp_path: Path, twin_code: str, say: Callable[[str], None] = lambda _: None, *, watched: bool = True
) -> tuple[ServiceProcess, ServiceProcess, Supervisor, Handoff]:
    """A started eager replica (supervised unless not `watched`), its twin running `twin_code` (not
    launched) and their handoff."""
    eager = process(tmp_path, "rollout-0", SERVE)
    twin = process(tmp_path, "rollout-0-compiled", twin_code)
    eager.start("ready", timeout_s=30)
    supervisor = Supervisor(Backoff(), say=say)
    if watched:
        supervisor.watch(eager, "ready")
    return eager, twin, supervisor, Handoff(eager, twin, "ready", say=say)


def test_a_ready_twin_takes_the_eager_replicas_place(tmp_path: Path) -> None:
    said: list[str] = []
    slow = f"import time; time.sleep(0.5); {SERVE.split('; ', 1)[1]}"
    eager, twin, supervisor, handoff = eager_and_twin(tmp_path, slow, said.append)
    scaler = LocalScaler(ScalePolicy(1, 2), lambda i: eager, "ready", [eager])
    try:
        handoff.begin(supervisor, scaler)
        until(lambda: handoff.outcome is not None and not eager.running())
        assert [w.proc for w in supervisor.watched] == [twin]
        assert scaler.replicas == [twin] and twin.running()
        assert handoff.outcome.startswith("rollout-0-compiled ready after")
        assert said[-1] == f"handoff: {handoff.outcome}"
    finally:
        supervisor.close()
        for proc in (twin, eager):
            proc.stop(grace_s=5)


def test_a_twin_that_does_not_start_leaves_the_eager_replica_serving(tmp_path: Path) -> None:
    said: list[str] = []
    eager, _twin, supervisor, handoff = eager_and_twin(tmp_path, "import sys; sys.exit(3)", said.append)
    try:
        handoff.begin(supervisor, None)
        until(lambda: handoff.outcome is not None)
        assert "did not start" in handoff.outcome and "rollout-0 keeps serving eagerly" in handoff.outcome
        assert [w.proc for w in supervisor.watched] == [eager] and eager.running()
    finally:
        supervisor.close()
        eager.stop(grace_s=5)


def test_nothing_is_handed_over_once_supervision_closed(tmp_path: Path) -> None:
    slow = f"import time; time.sleep(1); {SERVE.split('; ', 1)[1]}"
    eager, twin, supervisor, handoff = eager_and_twin(tmp_path, slow)
    try:
        handoff.begin(supervisor, None)
        supervisor.close()  # the run ended while the twin built
        time.sleep(2)
        assert handoff.outcome is None and eager.running()
    finally:
        for proc in (twin, eager):
            proc.stop(grace_s=5)


def test_the_twin_launches_only_once_after_says_so(tmp_path: Path) -> None:
    eager, twin, supervisor, handoff = eager_and_twin(tmp_path, SERVE)
    go = False
    try:
        handoff.begin(supervisor, None, lambda: go)
        time.sleep(1.5)  # three polls
        assert twin.proc is None and handoff.outcome is None
        go = True
        until(lambda: handoff.outcome is not None and not eager.running())
        assert [w.proc for w in supervisor.watched] == [twin] and twin.running()
    finally:
        supervisor.close()
        for proc in (twin, eager):
            proc.stop(grace_s=5)


def test_a_twin_waiting_to_launch_never_does_once_supervision_closed(tmp_path: Path) -> None:
    eager, twin, supervisor, handoff = eager_and_twin(tmp_path, SERVE, watched=False)
    go = False
    try:
        handoff.begin(supervisor, None, lambda: go)
        supervisor.close()  # the run ended before its first step
        go = True
        time.sleep(1.5)
        assert twin.proc is None and handoff.outcome is None
    finally:
        for proc in (twin, eager):
            proc.stop(grace_s=5)
