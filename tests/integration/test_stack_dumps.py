"""`kill -USR1 PID` on a running service writes every thread's Python stack and the service goes on
(`runtime.logs.enable_stack_dumps`, installed by `rlfabric serve` for every service): what an operator
looks at first when a run stops making progress, and what the fault suite collects when a wait times out.
A service whose event loop stops turning writes the same stacks itself and exits with code 75
(`runtime.watchdog.watch_event_loop`), so that whoever started it restarts it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import grpc
import pytest
from standalone_replica import start_replica

from rlfabric.local.procs import ServiceProcess
from rlfabric.runtime import failpoints
from rlfabric.runtime.watchdog import EXIT_STALLED
from rlfabric.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc

TOKEN = "stack-dump-token"


def score(address: str, timeout_s: float = 30) -> float:
    """One exact_match Score call with the token; the reward it got."""
    request = reward_pb2.ScoreRequest(
        scorer=reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name="exact_match")),
        items=[reward_pb2.ScoreItem(id="0", completion="42", reference="42")],
    )
    with grpc.insecure_channel(address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        response = stub.Score(request, timeout=timeout_s, metadata=(("authorization", f"Bearer {TOKEN}"),))
    return float(response.results[0].reward.value)


def test_sigusr1_writes_every_threads_stack_and_the_service_keeps_serving(tmp_path: Path) -> None:
    proc = ServiceProcess(
        "reward",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0",
            "--set", "workers=1", "--set", "log.format=text",
        ],
        log_path=tmp_path / "reward.log",
        env={**os.environ, "RLFABRIC_REWARD__TOKEN": TOKEN},
    )  # fmt: skip
    try:
        address = proc.start(r"listening on (\S+)", timeout_s=60).group(1)
        assert score(address) == 1.0  # serving: its main coroutine now waits for termination
        proc.signal(signal.SIGUSR1)
        proc.wait_for(r"^(Current thread|Thread) 0x[0-9a-f]+", timeout_s=30)
        # the main thread's stack names the code it waits in, down to the service's own entry
        proc.wait_for(r'File ".*rlfabric[/\\]reward[/\\]main\.py", line \d+ in serve', timeout_s=30)
        # then each asyncio task's stack: the reward server's coroutine, at the await it waits at
        proc.wait_for(r"^\d+ asyncio task\(s\) \(most recent call last\):", timeout_s=30)
        proc.wait_for(r"^Task \S+ \(<coroutine object ", timeout_s=30)
        proc.wait_for(r'File ".*rlfabric[/\\]reward[/\\]main\.py", line \d+, in run$', timeout_s=30)
        waits_in = r'File ".*rlfabric[/\\]runtime[/\\]grpc_server\.py", line \d+, in wait_for_termination'
        proc.wait_for(waits_in, timeout_s=30)
        assert proc.running(), "SIGUSR1 ended the service"

        assert score(address) == 1.0
    finally:
        proc.stop()


def test_a_service_whose_event_loop_blocks_ends_itself_with_its_stacks(tmp_path: Path) -> None:
    """A Score call blocks the reward service's event loop for good (a failpoint that hangs in the
    handler): no RPC can be answered, health checks included, yet the process is alive. After its
    `stall_timeout_s` (10 s) it writes every stack, the blocking handler's among them, and exits 75."""
    proc = ServiceProcess(
        "reward",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0",
            "--set", "workers=1", "--set", "log.format=text", "--set", "stall_timeout_s=10",
        ],
        log_path=tmp_path / "reward.log",
        env={**os.environ, "RLFABRIC_REWARD__TOKEN": TOKEN, failpoints.ENV: "reward.score=2:hang"},
    )  # fmt: skip
    try:
        address = proc.start(r"listening on (\S+)", timeout_s=60).group(1)
        assert score(address) == 1.0  # the first call is served; the second blocks the loop
        with pytest.raises(grpc.RpcError) as blocked:
            score(address, timeout_s=3)
        assert blocked.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert_ended_itself(proc, "the reward service's event loop", r"reward[/\\]server\.py", "Score")
    finally:
        proc.stop()


def test_an_idle_replica_whose_event_loop_blocks_ends_itself(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The same for a rollout replica with nothing in flight (a GetInfo call blocks its loop): its engine's
    watchdog counts only while prompts are in flight, and a blocked loop admits none, so the loop's own
    watchdog is what ends it."""
    log = tmp_path / "rollout.log"
    proc, address = start_replica(
        tiny_model_dir, log, TOKEN, "stall_timeout_s=10", failpoints="rollout.get_info=1:hang"
    )
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as blocked:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            stub.GetInfo(
                rollout_pb2.GetInfoRequest(), timeout=3, metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
        assert blocked.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert_ended_itself(proc, "the replica's event loop", r"rollout[/\\]server\.py", "GetInfo")
    finally:
        proc.stop()


def assert_ended_itself(proc: ServiceProcess, what: str, file: str, function: str) -> None:
    """`what`'s watchdog fired: its message, then the blocking frame (`function` in `file`, a pattern
    under `rlfabric/`) among the stacks, then the exit with EXIT_STALLED."""
    proc.wait_for(rf"{what} made no progress for \d+ s", timeout_s=60)
    proc.wait_for(rf'File ".*rlfabric[/\\]{file}", line \d+ in {function}', timeout_s=30)
    assert proc.proc is not None and proc.proc.wait(30) == EXIT_STALLED
