"""`kill -USR1 PID` on a running service writes every thread's Python stack and the service goes on
(`runtime.logs.enable_stack_dumps`, installed by `rlfabric serve` for every service): what an operator
looks at first when a run stops making progress, and what the fault suite collects when a wait times out.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import grpc

from rlfabric.local.procs import ServiceProcess
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

TOKEN = "stack-dump-token"


def score(address: str) -> float:
    """One exact_match Score call with the token; the reward it got."""
    request = reward_pb2.ScoreRequest(
        scorer=reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name="exact_match")),
        items=[reward_pb2.ScoreItem(id="0", completion="42", reference="42")],
    )
    with grpc.insecure_channel(address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        response = stub.Score(request, timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
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
