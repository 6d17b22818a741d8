"""Credentials on by default, checked on real processes and real gRPC servers.

Every `rlfabric serve NAME` refuses to start without its token (one line naming the environment variable,
exit status 2) unless started with `--insecure`, which serves and logs a WARNING. The reward service
answers Score and ListScorers UNAUTHENTICATED without its token or with a wrong one (health stays open),
its CLI presents `--token`; the coordinator answers /v1 with 401 without its token; the learner's
GetStatus requires the learner's token. A replica needs the learner's token and its clients'; UpdateWeights
without the learner's token, and Generate or GetInfo without the clients', are refused in
tests/integration/rollout/test_rollout_service.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.learner.leader import Status
from rlfabric.local.procs import ServiceProcess
from rlfabric.runtime.grpc_server import GrpcServer, full_service_name
from rlfabric.v1 import learner_pb2, learner_pb2_grpc, reward_pb2, reward_pb2_grpc

TOKEN = "credentials-suite-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfabric.cli", *args]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any rlfabric setting but the metrics ports (tests/conftest.py sets
    them to 0: the fixed defaults would collide between services on one machine), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith("RLFABRIC_") or k.upper().endswith("__SERVER__METRICS_PORT")
    }
    return {**env, **extra}


def learner_config(folder: Path, model: Path) -> Path:
    prompts = folder / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "say x"}) + "\n")
    run = {"name": "cred", "model": {"path": str(model)}, "dataset": {"path": str(prompts)}}
    path = folder / "learner.yaml"
    path.write_text(yaml.safe_dump({"run_id": "cred", "server": {"port": 0}, "run": run}))
    return path


def serve_argv(service: str, tmp_path: Path, model: Path) -> list[str]:
    """`rlfabric serve SERVICE` with everything it needs but credentials."""
    if service == "rollout":
        return cli("serve", "rollout", "--model", str(model), "--engine", "transformers", "--port", "0")
    if service == "learner":
        return cli("serve", "learner", "--config", str(learner_config(tmp_path, model)))
    return cli("serve", service, "--port", "0")


REFUSALS = {
    "reward": ({}, ["RLFABRIC_REWARD__TOKEN"]),
    "rollout": ({}, ["RLFABRIC_ROLLOUT__LEARNER_TOKEN", "RLFABRIC_ROLLOUT__CLIENT_TOKEN"]),
    "rollout-without-client-token": (
        {"RLFABRIC_ROLLOUT__LEARNER_TOKEN": TOKEN},
        ["RLFABRIC_ROLLOUT__CLIENT_TOKEN"],
    ),
    "learner": ({}, ["RLFABRIC_LEARNER__TOKEN"]),
    "coordinator": (
        {},
        [
            "RLFABRIC_COORDINATOR__API__TOKEN",
            "RLFABRIC_COORDINATOR__REWARD_TOKEN",
            "RLFABRIC_COORDINATOR__ROLLOUT_TOKEN",
        ],
    ),
    "coordinator-without-reward-token": (
        {"RLFABRIC_COORDINATOR__API__TOKEN": TOKEN, "RLFABRIC_COORDINATOR__ROLLOUT_TOKEN": TOKEN},
        ["RLFABRIC_COORDINATOR__REWARD_TOKEN"],
    ),
    "coordinator-without-rollout-token": (
        {"RLFABRIC_COORDINATOR__API__TOKEN": TOKEN, "RLFABRIC_COORDINATOR__REWARD_TOKEN": TOKEN},
        ["RLFABRIC_COORDINATOR__ROLLOUT_TOKEN"],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_service_without_its_credential_refuses_to_start(
    case: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    given, missing = REFUSALS[case]
    service = case.split("-")[0]
    result = subprocess.run(
        serve_argv(service, tmp_path, tiny_model_dir),
        env=clean_env(**given),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlfabric: the {service} service needs a credential"), result.stderr
    assert all(name in last for name in missing) and "--insecure" in last
    named = {w.strip("(),") for w in last.split() if w.startswith("RLFABRIC_")}
    assert named == set(missing), last  # a credential that was given is not asked for
    assert "listening" not in result.stdout


def warnings_logged(path: Path) -> list[dict[str, Any]]:
    """The WARNING records of a JSON-lines service log."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [r for r in records if r.get("level") == "WARNING"]


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A reward service holding TOKEN."""
    log = tmp_path_factory.mktemp("reward") / "reward.log"
    argv = cli("serve", "reward", "--port", "0", "--set", "workers=1")
    proc = ServiceProcess("reward", argv, log_path=log, env=clean_env(RLFABRIC_REWARD__TOKEN=TOKEN))
    yield proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    assert proc.stop() == 0
    assert not any(r.get("insecure") for r in warnings_logged(log))


def exact_match_request() -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(
        scorer=reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name="exact_match")),
        items=[reward_pb2.ScoreItem(id="a", completion="42", reference="42")],
    )


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),)],
    ids=["none", "wrong", "not-bearer"],
)
def test_reward_refuses_calls_without_the_token(reward: str, metadata: tuple[tuple[str, str], ...]) -> None:
    with grpc.insecure_channel(reward) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for call, request in [
            (stub.Score, exact_match_request()),
            (stub.ListScorers, reward_pb2.ListScorersRequest()),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def test_reward_answers_the_token_and_health_stays_open(reward: str) -> None:
    with grpc.insecure_channel(reward) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        [result] = stub.Score(exact_match_request(), timeout=10, metadata=AUTH).results
        assert result.reward.value == 1.0
        assert stub.ListScorers(reward_pb2.ListScorersRequest(), timeout=10, metadata=AUTH).scorers
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_reward_cli_presents_its_token(reward: str) -> None:
    def listing(*extra: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = cli("reward", "list", "--server", reward, "--json", *extra)
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    refused = listing(env=clean_env())
    assert refused.returncode == 1
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .endswith("answered UNAUTHENTICATED: missing or invalid bearer token")
    )
    assert listing("--token", TOKEN, env=clean_env()).returncode == 0
    from_env = listing(env=clean_env(RLFABRIC_REWARD_TOKEN=TOKEN))
    assert from_env.returncode == 0 and "exact_match" in from_env.stdout


def test_reward_insecure_serves_without_a_token_and_warns(tmp_path: Path) -> None:
    log = tmp_path / "reward.log"
    argv = cli("serve", "reward", "--port", "0", "--set", "workers=1", "--insecure")
    proc = ServiceProcess("reward", argv, log_path=log, env=clean_env())
    address = proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    try:
        with grpc.insecure_channel(address) as channel:
            reply = reward_pb2_grpc.RewardServiceStub(channel).Score(exact_match_request(), timeout=10)
        assert reply.results[0].reward.value == 1.0
    finally:
        assert proc.stop() == 0
    [warning] = [r for r in warnings_logged(log) if r.get("insecure")]
    assert warning["service"] == "reward" and "--insecure" in warning["msg"]


def start_coordinator(
    tmp_path: Path, redis_url: str, env: dict[str, str], *flags: str
) -> tuple[ServiceProcess, str]:
    argv = cli("serve", "coordinator", "--port", "0", "--set", f"redis.url={redis_url}", *flags)
    proc = ServiceProcess("coordinator", argv, log_path=tmp_path / "coordinator.log", env=env)
    return proc, proc.start(r"listening on (http://\S+)", timeout_s=60).group(1)


def test_coordinator_requires_its_token(tmp_path: Path, redis_url: str) -> None:
    env = clean_env(
        RLFABRIC_COORDINATOR__API__TOKEN=TOKEN,
        RLFABRIC_COORDINATOR__REWARD_TOKEN="r",
        RLFABRIC_COORDINATOR__ROLLOUT_TOKEN="g",
    )
    proc, url = start_coordinator(tmp_path, redis_url, env)
    try:
        assert httpx.get(f"{url}/v1/runs", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer wrong-token"}
        assert httpx.get(f"{url}/v1/runs", headers=wrong, timeout=10).status_code == 401
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{url}/v1/runs", headers=good, timeout=10).status_code == 200
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    finally:
        proc.stop()


def test_coordinator_insecure_serves_without_a_token_and_warns(tmp_path: Path, redis_url: str) -> None:
    proc, url = start_coordinator(tmp_path, redis_url, clean_env(), "--insecure")
    try:
        assert httpx.get(f"{url}/v1/runs", timeout=10).status_code == 200
    finally:
        proc.stop()
    [warning] = [r for r in warnings_logged(tmp_path / "coordinator.log") if r.get("insecure")]
    assert warning["service"] == "coordinator"


async def test_learner_status_requires_the_learner_token() -> None:
    server = GrpcServer()
    service = full_service_name(learner_pb2, "LearnerService")
    server.add_servicer(
        learner_pb2_grpc.add_LearnerServiceServicer_to_server, Status("cred", 1, TOKEN), service
    )
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = learner_pb2_grpc.LearnerServiceStub(channel)
            for metadata in [(), (("authorization", "Bearer wrong-token"),)]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetStatus(learner_pb2.GetStatusRequest(), metadata=metadata, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            status = await stub.GetStatus(learner_pb2.GetStatusRequest(), metadata=AUTH, timeout=10)
            assert status.run_id == "cred"
    finally:
        await server.stop(0)
