"""SIGKILL each service mid-run (and restart Redis) with the whole loop running as real processes; the run
completes and the ledger balances: nothing dispatched is lost, nothing is trained twice.

The learner's own crash points are also proven in isolation, against hand-made groups, by
tests/integration/learner/test_learner_service.py (`test_killed_learner_resumes_...`); here they happen
inside a live loop, with the coordinator still producing while the learner is down.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import pytest
from fault_stack import Stack

from rlfabric.runtime.watchdog import EXIT_STALLED


def test_rollout_replica_sigkilled_mid_generation(make_stack: Callable[..., Stack]) -> None:
    """rollout-0 SIGKILLs itself at its 5th sample (`rollout.mid_generate`), before streaming it: it dies
    holding a request, which the coordinator sends again. (Catching it busy from outside raced: a 24-step
    run once completed in 4.5 s before the registry showed it holding a request.)"""
    stack = make_stack(train={"steps": 12})
    stack.start(replicas=2, replica_failpoints={"rollout-0": "rollout.mid_generate=5"})
    replica = stack.procs["rollout-0"].proc
    assert replica is not None
    assert replica.wait(180) == -9, stack.tails()  # killed itself mid-generation
    status = stack.finish()
    assert status["counters"]["redispatches"] >= 1, status["counters"]
    stack.books()


def test_a_hung_replica_ends_itself_and_its_requests_go_elsewhere(make_stack: Callable[..., Stack]) -> None:
    """rollout-0 hangs at its 5th sample (`rollout.mid_generate=5:hang`: its event loop blocked for good,
    holding a request, the process alive). Its watchdog (`stall_timeout_s`) writes every stack and exits with
    code 75; the coordinator sends the request it held to rollout-1 and the run completes."""
    stack = make_stack(train={"steps": 12})
    stack.start(
        replicas=2,
        replica_failpoints={"rollout-0": "rollout.mid_generate=5:hang"},
        replica_settings={"rollout-0": ("stall_timeout_s=15",)},
    )
    replica = stack.procs["rollout-0"]
    assert replica.proc is not None
    try:
        code = replica.proc.wait(180)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"rollout-0 still running after 180 s\n{stack.tails()}\n{stack.stacks()}"
        ) from None
    assert code == EXIT_STALLED, stack.tails()
    output = replica.log_path.read_text()
    assert "the replica's engine made no progress for" in output, stack.tails()
    assert re.search(r'File ".*failpoints\.py", line \d+ in hit', output), output[-3000:]  # where it hung
    status = stack.finish()
    assert status["counters"]["redispatches"] >= 1, status["counters"]
    stack.books()


@pytest.mark.parametrize(
    "failpoint",
    [
        "learner.after_step=3",
        pytest.param("learner.after_read=3", marks=pytest.mark.faults_full),
        pytest.param("learner.before_ack=2", marks=pytest.mark.faults_full),
    ],
)
def test_learner_sigkilled_at_a_failpoint_resumes(make_stack: Callable[..., Stack], failpoint: str) -> None:
    stack = make_stack()
    stack.start(failpoints=failpoint)
    learner = stack.procs["learner"].proc
    assert learner is not None
    assert learner.wait(180) == -9, stack.tails()  # killed itself at the failpoint, mid-run
    stack.start_learner()  # resumes from its last complete checkpoint
    stack.finish()
    stack.books()
    stack.assert_every_step_trained()
    if failpoint.startswith("learner.before_ack"):  # checkpointed, never acknowledged: redelivered, skipped
        assert stack.last_metrics()["queue_skipped_duplicate"] >= 1


def test_a_hung_learner_ends_itself_and_resumes(make_stack: Callable[..., Stack]) -> None:
    """After step 3 the learner hangs: a failpoint blocks its event loop for good, the process alive and
    making no progress, which no supervisor notices. Its watchdog (`stall_timeout_s`, `runtime.watchdog`)
    writes every stack, the hang's among them, and exits with code 75; started again, as its supervisor
    does, it resumes from its last checkpoint, the run completes and the books balance."""
    stack = make_stack()
    stack.start(failpoints="learner.after_step=3:hang", learner_settings={"stall_timeout_s": 15})
    learner = stack.procs["learner"]
    assert learner.proc is not None
    assert learner.proc.wait(180) == EXIT_STALLED, stack.tails()
    output = learner.log_path.read_text()
    assert "made no progress for" in output and "(the last was: step 3 trained)" in output, stack.tails()
    assert re.search(r'File ".*failpoints\.py", line \d+ in hit', output), output[-3000:]  # where it hung
    assert "asyncio task(s) (most recent call last)" in output
    stack.start_learner()
    stack.finish()
    stack.books()
    stack.assert_every_step_trained()


def test_coordinator_sigkilled_mid_run_and_restarted(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack()
    stack.start()
    stack.wait_for_step(2)
    stack.kill("coordinator")
    stack.start_coordinator()  # resumes the run: its cursor from Redis, its in-flight groups re-dispatched
    stack.finish()
    stack.books()


def test_reward_service_sigkilled_and_restarted(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack()
    stack.start()
    stack.wait_for_step(2)
    stack.kill("reward")
    stack.start_reward()  # same port: the coordinator's scoring calls fail meanwhile and are retried
    stack.finish()
    stack.books()


def test_redis_frozen_mid_run(make_stack: Callable[..., Stack]) -> None:
    """Redis stops answering for 25 s (SIGSTOP: connections open, commands unanswered, longer than the
    clients' 10 s socket timeout) and then carries on with what it had buffered. Commands sent before the
    freeze may run after the client gave up on them and retried: every write of the books must be safe to
    run twice. The run completes and the books balance."""
    stack = make_stack()
    stack.start()
    stack.wait_for_step(2)
    stack.freeze_redis(25)
    stack.finish()
    stack.books()


@pytest.mark.parametrize("sigkill", [False, pytest.param(True, marks=pytest.mark.faults_full)])
def test_redis_restarted_mid_run(make_stack: Callable[..., Stack], sigkill: bool) -> None:
    stack = make_stack()
    if sigkill:
        stack.appendfsync = "always"  # everysec may lose the last second of writes to a SIGKILL
    stack.start()
    stack.wait_for_step(2)
    stack.restart_redis(sigkill=sigkill)
    stack.finish()
    stack.books()
