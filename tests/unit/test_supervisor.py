"""`rlfabric.local.supervisor`: the backoff schedule, and restarts of real (guarded) processes: a dead process
comes back by the same object, a clean exit of a process that finishes is left alone, and a process that
keeps dying is given up with a message that names it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rlfabric.local.procs import ServiceProcess
from rlfabric.local.supervisor import Backoff, Supervisor
from rlfabric.runtime.watchdog import EXIT_STALLED

FAST = Backoff(base_s=0.05, cap_s=0.2, stable_s=60.0, max_fast_failures=3)


def test_backoff_doubles_from_one_second_and_caps_at_thirty() -> None:
    backoff = Backoff()
    assert [backoff.delay(n) for n in range(8)] == [1, 1, 2, 4, 8, 16, 30, 30]


def until(check: Callable[[], bool], supervisor: Supervisor, timeout_s: float = 30.0) -> None:
    """Polls the supervisor (as `up`'s watch loop does) until `check()` holds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        supervisor.poll()
        time.sleep(0.05)


def process(tmp_path: Path, code: str) -> ServiceProcess:
    argv = [sys.executable, "-c", f"print('ready', flush=True); {code}"]
    return ServiceProcess("svc", argv, log_path=tmp_path / "svc.log", guarded=True)


@pytest.fixture
def said() -> list[str]:
    return []


def test_a_dead_process_is_restarted_and_counted(tmp_path: Path, said: list[str]) -> None:
    proc = process(tmp_path, "import time; time.sleep(60)")
    proc.start("ready", timeout_s=30)
    supervisor = Supervisor(FAST, say=said.append)
    supervisor.watch(proc, "ready")
    first = proc.pid
    try:
        proc.kill()
        until(lambda: proc.running() and proc.pid != first and "is back" in said[-1], supervisor)
        assert supervisor.restarts == {"svc": 1}
        assert said[0].startswith("supervise: svc exited with code")
    finally:
        supervisor.close()
        proc.stop(grace_s=5)


def test_a_process_its_watchdog_ended_is_restarted_and_said_to_have_hung(
    tmp_path: Path, said: list[str]
) -> None:
    proc = process(tmp_path, f"import os; os._exit({EXIT_STALLED})")
    proc.start("ready", timeout_s=30)
    supervisor = Supervisor(FAST, say=said.append)
    supervisor.watch(proc, "ready")
    try:
        until(lambda: bool(said), supervisor)
        assert said[0].startswith(f"supervise: svc exited with code {EXIT_STALLED} after ")
        assert f"(it hung: no progress for its stall_timeout_s; every stack is in {proc.log_path})" in said[0]
        assert supervisor.hangs == {"svc": 1}
    finally:
        supervisor.close()
        proc.stop(grace_s=5)


def test_a_process_that_keeps_dying_is_given_up(tmp_path: Path, said: list[str]) -> None:
    proc = process(tmp_path, "raise SystemExit(4)")
    proc.start("ready", timeout_s=30)
    supervisor = Supervisor(FAST, say=said.append)
    supervisor.watch(proc, "ready")
    until(lambda: supervisor.gave_up is not None, supervisor)
    assert "svc died 3 times in a row" in (supervisor.gave_up or "")
    assert "last exit code 4" in (supervisor.gave_up or "")
    assert supervisor.restarts == {"svc": 2}  # the third death gives up instead of restarting


def test_a_clean_exit_of_a_finishing_process_is_not_restarted(tmp_path: Path, said: list[str]) -> None:
    proc = process(tmp_path, "pass")
    proc.start("ready", timeout_s=30)
    proc.stop(grace_s=5)
    supervisor = Supervisor(FAST, say=said.append)
    supervisor.watch(proc, "ready", restart_clean_exit=False)
    for _ in range(5):
        supervisor.poll()
        time.sleep(0.1)
    assert not proc.running() and supervisor.restarts == {} and said == []


def test_nothing_is_launched_after_close(tmp_path: Path, said: list[str]) -> None:
    proc = process(tmp_path, "import time; time.sleep(60)")
    proc.start("ready", timeout_s=30)
    supervisor = Supervisor(Backoff(base_s=0.5), say=said.append)
    supervisor.watch(proc, "ready")
    proc.kill()
    supervisor.poll()  # schedules a restart in 0.5 s
    supervisor.close()
    time.sleep(1.0)
    assert not proc.running()


def test_a_killed_guard_leaves_nothing_of_its_service_behind(tmp_path: Path, said: list[str]) -> None:
    """SIGKILL of the guard alone (not its group): the service follows it (PDEATHSIG), the service's child
    is orphaned in the guard's process group, and the supervisor sweeps that group before restarting."""
    import os
    import signal

    import psutil

    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    proc = process(tmp_path, code)
    proc.start("ready", timeout_s=30)
    supervisor = Supervisor(FAST, say=said.append)
    supervisor.watch(proc, "ready")
    try:
        until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", supervisor)
        grandchild = psutil.Process(int(pid_file.read_text()))
        os.kill(proc.pid, signal.SIGKILL)  # the guard only, as a careless operator would
        until(lambda: bool(said) and "exited with code" in said[0], supervisor)

        def gone() -> bool:
            try:
                return grandchild.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        until(gone, supervisor, timeout_s=10)
    finally:
        supervisor.close()
        proc.stop(grace_s=5)
