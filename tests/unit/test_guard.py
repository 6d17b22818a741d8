"""`rlfabric.runtime.guard` with real processes: nothing a guarded service started outlives the service, and
nothing outlives the guard's parent, even one SIGKILLed, even a grandchild that left for its own session
(as vLLM's engine and resource tracker are separate processes below a replica)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfabric.local.procs import ServiceProcess

SERVICE = """
import os, signal, subprocess, sys, time
# a grandchild in a session of its own: a process-group kill of the service would miss it
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
if sys.argv[1] == "ignore":  # deaf to SIGTERM: only the SIGKILL after the grace ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(sys.argv[1])))
signal.signal(signal.SIGUSR1, lambda *_: print("stacks asked", flush=True))
print(f"service {os.getpid()} grandchild {grandchild.pid}", flush=True)
while True:
    time.sleep(1)
"""

PARENT = """
import json, sys
from rlfabric.local.procs import ServiceProcess
argv = [sys.executable, "-c", sys.argv[1], sys.argv[3]]
proc = ServiceProcess("svc", argv, log_path=sys.argv[2], guarded=True, guard_grace_s=1.0)
match = proc.start(r"service (\\d+) grandchild (\\d+)", timeout_s=60)
print(json.dumps({"guard": proc.pid, "service": proc.service_pid, "grandchild": int(match[2])}), flush=True)
input()  # until killed
"""


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """The pids still alive after `timeout_s` (empty when all went)."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def start_service(tmp_path: Path, exit_code: int = 0) -> tuple[ServiceProcess, int]:
    proc = ServiceProcess(
        "svc", [sys.executable, "-c", SERVICE, str(exit_code)], log_path=tmp_path / "svc.log", guarded=True
    )
    match = proc.start(r"service (\d+) grandchild (\d+)", timeout_s=60)
    assert proc.service_pid == int(match[1]) != proc.pid
    return proc, int(match[2])


def test_a_killed_service_takes_its_grandchildren_along(tmp_path: Path) -> None:
    proc, grandchild = start_service(tmp_path)
    try:
        assert alive(grandchild)
        os.kill(proc.service_pid or 0, signal.SIGKILL)
        assert proc.proc is not None
        assert proc.proc.wait(timeout=15) == 128 + signal.SIGKILL  # the guard reports the death by signal
        assert wait_gone([grandchild]) == []
    finally:
        kill_all([grandchild])
        proc.kill()


def test_sigterm_reaches_the_service_and_its_exit_code_comes_back(tmp_path: Path) -> None:
    proc, grandchild = start_service(tmp_path, exit_code=3)
    try:
        assert proc.stop(grace_s=15) == 3
        assert wait_gone([grandchild]) == []
    finally:
        kill_all([grandchild])


def test_sigusr1_reaches_the_service_which_goes_on(tmp_path: Path) -> None:
    """`kill -USR1` of a guard asks its service for its stacks (`runtime.logs.enable_stack_dumps`)."""
    proc, grandchild = start_service(tmp_path)
    try:
        proc.signal(signal.SIGUSR1)
        proc.wait_for("stacks asked", timeout_s=15)
        time.sleep(0.5)
        assert proc.running() and alive(proc.service_pid or 0)
    finally:
        kill_all([grandchild])
        proc.kill()


@pytest.mark.parametrize(
    ("sig", "service"), [(signal.SIGKILL, "0"), (signal.SIGTERM, "0"), (signal.SIGKILL, "ignore")]
)
def test_nothing_outlives_a_killed_parent(tmp_path: Path, sig: signal.Signals, service: str) -> None:
    """The parent (standing in for `rlfabric up`) dies without stopping anything: within the guard's
    grace (1 s here) and a poll, the guard, the service (even one deaf to SIGTERM) and the grandchild in
    its own session are gone."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, SERVICE, str(tmp_path / "svc.log"), service],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    pids = json.loads(parent.stdout.readline())
    try:
        assert all(alive(pid) for pid in pids.values()), pids
        parent.send_signal(sig)
        parent.wait(timeout=15)
        assert wait_gone(list(pids.values()), timeout_s=10) == [], pids
    finally:
        kill_all(list(pids.values()))
        parent.kill()


def test_a_guarded_process_can_be_launched_again(tmp_path: Path) -> None:
    """A restart: the same object, a new process, the log continued."""
    proc = ServiceProcess(
        "once",
        [sys.executable, "-c", "print('hello', flush=True)"],
        log_path=tmp_path / "o.log",
        guarded=True,
    )
    proc.start(r"hello", timeout_s=30)
    assert proc.stop(grace_s=10) == 0
    first = proc.pid
    proc.start(r"hello", timeout_s=30)
    assert proc.stop(grace_s=10) == 0
    assert proc.pid != first
    assert (tmp_path / "o.log").read_text().count("hello") == 2


def test_cpus_confine_the_service_and_what_it_starts(tmp_path: Path) -> None:
    """`cpus`: the guard sets the core set before the service starts, so the service's children inherit it."""
    core = min(os.sched_getaffinity(0))
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    script = "import os, subprocess, sys; print('cores', sorted(os.sched_getaffinity(0)), flush=True); "
    script += f"subprocess.run([sys.executable, '-c', {child!r}]); print('done', flush=True)"
    proc = ServiceProcess(
        "pinned", [sys.executable, "-c", script], log_path=tmp_path / "p.log", guarded=True, cpus=str(core)
    )
    proc.start(r"done", timeout_s=30)
    assert proc.stop(grace_s=10) == 0
    assert (tmp_path / "p.log").read_text().splitlines()[1:] == [f"cores [{core}]", f"[{core}]", "done"]


@pytest.mark.parametrize("text", ["", "a", "3-1", "1,,2", "1-"])
def test_malformed_cpus_are_refused(text: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlfabric.runtime.guard", "--cpus", text, "--", "true"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--cpus" in result.stderr, result.stderr
