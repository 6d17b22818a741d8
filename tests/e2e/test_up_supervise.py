"""`rlfabric up` heals and cleans up after itself, with real processes (the transformers engine keeps the
starts short on two cores):

1. SIGKILL of the learner, the replica and the coordinator mid-run: `up` restarts each (the learner
   resumes from its checkpoint, the replica rejoins under its id, the coordinator comes back on its port
   and resumes the run from Redis while `up`'s watch waits for it), the run completes, the books balance
   from the run's own Redis (AOF) and the learner's checkpoint, the summary counts the restarts, and no
   process `up` ever started is left once it exits.
2. SIGKILL of `up` itself mid-run: every process it started is gone within seconds (their guards see to
   it); `up --resume` on the same directory then finishes the run with its Redis data and credentials,
   and the books balance.
3. The same for two LoRA runs sharing one fleet replica (`up --runs 2 --lora 16`): `up --resume` finishes
   both, and each run's books balance.

Every process `up` started is recorded by PID while it runs (its descendants, sampled each poll).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from rlfabric.runtime import failpoints
from rlfabric.tools import ledger

STEPS = 14
"""The demo checkpoints every 10 steps: a kill after step 10 resumes from it, one before from scratch."""
TIMEOUT_S = 600.0


class Up:
    """One `rlfabric up` subprocess, its output file, and every PID seen below it."""

    def __init__(self, run_dir: Path, *args: str, env: dict[str, str]) -> None:
        self.run_dir, self.out = run_dir, run_dir.with_suffix(".out")
        argv = [sys.executable, "-m", "rlfabric.cli", "up", *args, "--no-progress"]
        with self.out.open("a") as sink:
            self.proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        self.seen: set[int] = set()

    def output(self) -> str:
        return self.out.read_text()

    def record_pids(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}

    def wait_for(self, what: str, check: Callable[[], Any]) -> Any:
        """Polls `check` (recording PIDs) until it returns something truthy."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            self.record_pids()
            if value := check():
                return value
            assert self.proc.poll() is None, f"`up` exited before {what}:\n{self.output()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"no {what} after {TIMEOUT_S:.0f} s:\n{self.output()[-3000:]}")

    def finish(self) -> int:
        deadline = time.monotonic() + TIMEOUT_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.record_pids()
            time.sleep(0.5)
        return self.proc.wait(timeout=5)

    def status(self, run: str = "demo") -> dict[str, Any] | None:
        match = re.search(r"page: (http://[\d.:]+)/runs/", self.output())
        if match is None:
            return None
        token = json.loads((self.run_dir / "credentials.json").read_text())["api"]
        try:
            response = httpx.get(f"{match[1]}/v1/runs/{run}", headers={"Authorization": f"Bearer {token}"})
            return dict(response.json()) if response.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def step(self, run: str = "demo") -> int:
        return int((self.status(run) or {}).get("step") or 0)

    def pid_of(self, name: str) -> int:
        return int(re.findall(rf"{name} (?:ready|is back) \(pid (\d+)", self.output())[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)


def survivors(pids: set[int], timeout_s: float = 15.0) -> list[str]:
    """The processes among `pids` still alive after `timeout_s` (zombies count as gone); those are then
    SIGKILLed, so that a failing test leaves nothing behind either."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for line in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    return left


@pytest.fixture(scope="module")
def env(vllm_env: dict[str, str]) -> dict[str, str]:
    return {**vllm_env, "PYTHONUNBUFFERED": "1"}


def balanced(
    run_dir: Path, reopen_aof: Callable[[Path], redis.Redis], runs: tuple[str, ...] = ("demo",)
) -> list[int]:
    """The ledger's check of each run (raises when the books do not balance); the groups each trained."""
    books = reopen_aof(run_dir)
    trained = []
    for name in runs:
        run = run_dir / name
        result = ledger.check(books, name, run / "checkpoints", weights_root=str(run / "weights"))
        trained.append(int(result.count()[ledger.TRAINED]))
    return trained


def kill_then_resume(
    run_dir: Path, argv: list[str], env: dict[str, str], runs: tuple[str, ...]
) -> tuple[Up, Up, int]:
    """`up ARGV` SIGKILLed once each of `runs` reached step 2 (nothing it started may survive), then
    `up --resume RUN_DIR` to its end: both, and the second's exit code."""
    first = Up(run_dir, *argv, env=env)
    try:
        first.wait_for("step 2", lambda: min(first.step(run) for run in runs) >= 2)
        first.record_pids()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
    finally:
        first.stop()
    assert survivors(first.seen) == []
    second = Up(run_dir, "--resume", str(run_dir), env=env)
    try:
        returncode = second.finish()
    finally:
        second.stop()
    return first, second, returncode


def test_up_restarts_a_killed_learner_and_replica(
    tmp_path: Path, env: dict[str, str], reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    up = Up(tmp_path / "run", "--run-dir", str(tmp_path / "run"), "--steps", str(STEPS),
            "--engine", "transformers", env=env)  # fmt: skip
    try:
        up.wait_for("step 2", lambda: up.step() >= 2)
        os.kill(up.pid_of("learner"), signal.SIGKILL)
        up.wait_for("the learner back", lambda: "supervise: learner is back" in up.output())
        os.kill(up.pid_of("rollout-0"), signal.SIGKILL)
        up.wait_for("the replica back", lambda: "supervise: rollout-0 is back" in up.output())
        os.kill(up.pid_of("coordinator"), signal.SIGKILL)  # up's own watch loses it, and waits
        up.wait_for("the coordinator back", lambda: "supervise: coordinator is back" in up.output())
        returncode = up.finish()
    finally:
        up.stop()
    output = up.output()
    assert returncode == 0 and f"run demo: completed at step {STEPS}" in output, output[-3000:]
    assert "restarts: 3 (coordinator 1, learner 1, rollout-0 1)" in output, output[-3000:]
    assert survivors(up.seen) == []
    assert balanced(tmp_path / "run", reopen_aof) == [STEPS * 8]


def test_up_restarts_a_hung_learner_replica_and_coordinator(
    tmp_path: Path, env: dict[str, str], reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    """The learner hangs after step 3, the replica while holding a request, and the coordinator's event
    loop after generating a group at about step 7 (failpoints that block, each once: their restarted selves
    pass). Each one's watchdog writes its stacks and exits with 75 after `stall_timeout_s`; `up` restarts
    it, says why, and the run completes with balanced books."""
    points = (
        f"learner.after_step=3:hang,rollout.mid_generate={3 * 64}:hang,coordinator.after_generate=56:hang"
    )
    hangs = {
        failpoints.ENV: points,
        failpoints.FIRED_ENV: str(tmp_path / "fired"),
        **{f"RLFABRIC_{service}__STALL_TIMEOUT_S": "10" for service in ("LEARNER", "ROLLOUT", "COORDINATOR")},
    }
    up = Up(tmp_path / "run", "--run-dir", str(tmp_path / "run"), "--steps", str(STEPS),
            "--engine", "transformers", env={**env, **hangs})  # fmt: skip
    try:
        returncode = up.finish()
    finally:
        up.stop()
    output = up.output()
    assert returncode == 0 and f"run demo: completed at step {STEPS}" in output, output[-3000:]
    fired = sorted(p.name for p in (tmp_path / "fired").iterdir())
    assert fired == ["coordinator.after_generate", "learner.after_step", "rollout.mid_generate"]
    for service in ("learner", "rollout-0", "coordinator"):
        assert re.search(rf"supervise: {service} exited with code 75 .*\(it hung", output), output[-3000:]
        log = (tmp_path / "run" / "logs" / f"{service}.log").read_text(errors="replace")
        assert "failpoints.py" in log and "no progress" in log, log[-2000:]
    assert "restarts: 3 (coordinator 1, learner 1, rollout-0 1; 3 after a hang)" in output, output[-3000:]
    assert survivors(up.seen) == []
    assert balanced(tmp_path / "run", reopen_aof) == [STEPS * 8]


def test_nothing_outlives_a_killed_up_and_resume_finishes_the_run(
    tmp_path: Path, env: dict[str, str], reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--engine", "transformers"]
    first, second, returncode = kill_then_resume(run_dir, argv, env, ("demo",))
    assert len(first.seen) >= 5, first.seen  # redis, reward, rollout, learner, coordinator and guards
    output = second.output()
    assert returncode == 0 and f"run demo: completed at step {STEPS}" in output, output[-3000:]
    assert "run demo was running" in output
    assert survivors(second.seen) == []
    assert balanced(run_dir, reopen_aof) == [STEPS * 8]


FLEET = ("demo-1", "demo-2")


def test_a_killed_up_of_two_runs_on_a_fleet_resumes_both(
    tmp_path: Path, env: dict[str, str], reopen_aof: Callable[[Path], redis.Redis]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["--run-dir", str(run_dir), "--runs", "2", "--lora", "16", "--steps", str(STEPS)]
    _, second, returncode = kill_then_resume(run_dir, argv, env, FLEET)
    output = second.output()
    assert returncode == 0, output[-3000:]
    for run in FLEET:
        assert f"run {run} was running" in output and f"run {run}: completed at step {STEPS}" in output, run
    assert survivors(second.seen) == []
    assert balanced(run_dir, reopen_aof, FLEET) == [STEPS * 8] * 2
