"""The reward service as users run it: `rlfabric serve reward` as a real process, called over gRPC.

Covers the contract (results per item, statuses, provenance), bad input answered with status codes while
the service keeps serving, deadlines that cancel work, the Python clients, reflection-only clients, the
Prometheus metrics and the standalone CLI. The service requires its token (as it does by default) and
every call here presents it; what a call without it gets is in tests/integration/test_credentials.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from rlfabric.local.procs import ServiceProcess
from rlfabric.reward.client import AsyncRewardClient, RewardClient
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc

TOKEN = "reward-suite-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
USER_FN = '''
import time

def reward_len(prompts, completions, **columns):
    """TRL signature; the `kind` column chooses a failure mode per row."""
    out = []
    for completion, kind in zip(completions, columns["kind"]):
        if kind == "sleep":
            time.sleep(60)
        if kind == "none":
            out.append(None)
        else:
            out.append(float(len(completion)))
    return out
'''


@pytest.fixture(scope="module")
def user_fn(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("fn") / "rewards.py"
    path.write_text(USER_FN)
    return f"{path}:reward_len"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, user_fn: str) -> Iterator[dict[str, str]]:
    """One reward service process with a single worker (so a hung worker would block the next call),
    allowed to load user functions from `user_fn`'s directory only."""
    logs = tmp_path_factory.mktemp("reward")
    allowed = json.dumps([str(Path(user_fn.rpartition(":")[0]).parent)])
    proc = ServiceProcess(
        "reward",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0",
            "--set", "workers=1", "--set", "max_batch_items=100", "--set", "max_item_bytes=20000",
            "--set", "server.metrics_port=0", "--set", "log.format=text",
            "--set", f"allowed_functions={allowed}",
        ],
        log_path=logs / "reward.log",
        env={**os.environ, "RLFABRIC_TEST_SECRET": "s3cret", "RLFABRIC_REWARD__TOKEN": TOKEN},
    )  # fmt: skip
    metrics = proc.start(r"metrics on (http://\S+)", timeout_s=60).group(1)
    address = proc.wait_for(r"listening on (\S+)", timeout_s=60).group(1)
    yield {"address": address, "metrics": metrics}
    assert proc.stop() == 0


@pytest.fixture
def client(server: dict[str, str]) -> Iterator[RewardClient]:
    with RewardClient(server["address"], timeout_s=30, token=TOKEN) as c:
        yield c


def item(i: int, completion: str, reference: str = "", **metadata: object) -> dict[str, object]:
    return {"id": f"i{i}", "prompt": "q", "completion": completion, "reference": reference, **metadata}


def assert_serving(address: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_math_verify_batch_scores_each_item_with_provenance(client: RewardClient) -> None:
    items = [
        item(0, "so \\boxed{0.5}", "\\frac{1}{2}"),
        item(1, "\\boxed{\\frac{2}{4}}", "0.5"),
        item(2, "\\boxed{3}", "4"),
        item(3, "no answer at all", "4"),
    ]
    results = client.score(items, "math_verify")
    assert [r.id for r in results] == ["i0", "i1", "i2", "i3"]
    assert [r.reward for r in results] == [1.0, 1.0, 0.0, 0.0]
    assert {r.status for r in results} == {"ok"}
    assert results[0].scorer_version == "math_verify@1"
    assert all(r.latency_s > 0 for r in results)


def test_one_failing_item_does_not_fail_its_neighbours(client: RewardClient, user_fn: str) -> None:
    items = [item(0, "abc", kind="ok"), item(1, "x", kind="none"), item(2, "hello", kind="ok")]
    results = client.score(items, "python_function", {"function": user_fn})
    assert [r.status for r in results] == ["ok", "not_applicable", "ok"]
    assert (results[0].reward, results[2].reward) == (3.0, 5.0)
    assert math.isnan(results[1].reward), "a failed item must never read as a reward"


def test_composite_reports_components(client: RewardClient) -> None:
    spec = {
        "scorer": "composite",
        "parts": [
            {"scorer": "math_verify", "weight": 1.0, "alias": "correct"},
            {"scorer": "regex", "weight": 0.5, "alias": "format", "params": {"pattern": r"\\boxed\{"}},
        ],
    }
    [good, unformatted] = client.score([item(0, "\\boxed{4}", "4"), item(1, "4", "4")], spec)
    assert good.reward == pytest.approx(1.5)
    assert good.components["correct"] == 1.0 and good.components["format"] == 1.0
    assert unformatted.components["format"] == 0.0
    assert "math_verify@1" in good.scorer_version and "regex@1" in good.scorer_version


def raw_score(address: str, request: reward_pb2.ScoreRequest, timeout: float = 10) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        reward_pb2_grpc.RewardServiceStub(channel).Score(request, timeout=timeout, metadata=AUTH)
    return info.value  # type: ignore[return-value]


def named(name: str, **params: object) -> reward_pb2.ScorerSpec:
    spec = reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name=name))
    spec.named.params.update(params)
    return spec


def ok_item() -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(id="a", prompt=common_pb2.Prompt(text="q"), completion="4", reference="4")


@pytest.mark.parametrize(
    ("request_", "code", "fragment"),
    [
        (
            reward_pb2.ScoreRequest(scorer=named("exact_match")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch is empty",
        ),
        (
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="a")], scorer=named("exact_match")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].completion",
        ),
        (
            reward_pb2.ScoreRequest(items=[ok_item()], scorer=named("nope")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "nope",
        ),
        (
            reward_pb2.ScoreRequest(items=[ok_item()], scorer=named("regex", pattern="(", bogus=1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "params.",
        ),
        (reward_pb2.ScoreRequest(items=[ok_item()]), grpc.StatusCode.INVALID_ARGUMENT, "named"),
        (
            reward_pb2.ScoreRequest(items=[ok_item()] * 101, scorer=named("exact_match")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "limit of 100",
        ),
        (
            reward_pb2.ScoreRequest(
                items=[reward_pb2.ScoreItem(id="big", completion="x" * 30000)], scorer=named("exact_match")
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "items[0]",
        ),
    ],
    ids=[
        "empty",
        "no-completion",
        "unknown-scorer",
        "bad-params",
        "no-spec",
        "batch-too-big",
        "item-too-big",
    ],
)
def test_bad_input_gets_a_clear_status_and_the_service_stays_up(
    server: dict[str, str], request_: reward_pb2.ScoreRequest, code: grpc.StatusCode, fragment: str
) -> None:
    error = raw_score(server["address"], request_)
    assert error.code() == code
    assert fragment in (error.details() or "")
    assert_serving(server["address"])


def assert_next_call_is_prompt(client: RewardClient) -> None:
    start = time.monotonic()
    [result] = client.score([item(1, "\\boxed{2}", "2")], "math_verify")
    assert result.status == "ok" and result.reward == 1.0
    assert time.monotonic() - start < 20, "the hung worker was not replaced"


def test_deadline_answers_timeout_and_frees_the_worker(
    client: RewardClient, server: dict[str, str], user_fn: str
) -> None:
    """A batch still running near the client's deadline is answered in time as TIMEOUT, never as a
    reward nor as the caller's DEADLINE_EXCEEDED (which would make the coordinator regenerate the group);
    the single worker is replaced, so the next call gets through."""
    with RewardClient(server["address"], timeout_s=3.0, token=TOKEN) as impatient:
        [result] = impatient.score([item(0, "x", kind="sleep")], "python_function", {"function": user_fn})
    assert result.status == "timeout" and math.isnan(result.reward)
    assert_next_call_is_prompt(client)


def test_cancelled_call_cancels_its_work(client: RewardClient, server: dict[str, str], user_fn: str) -> None:
    request = reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(id="s", completion="x", metadata={"kind": "sleep"})],
        scorer=named("python_function", function=user_fn),
    )
    with grpc.insecure_channel(server["address"]) as channel:
        future = reward_pb2_grpc.RewardServiceStub(channel).Score.future(request, timeout=120, metadata=AUTH)
        time.sleep(1.0)
        assert future.cancel()
    assert_next_call_is_prompt(client)


ATTACKS = {
    "infinite-loop": "while True:\n    pass",
    "fork-bomb": "import os\nwhile True:\n    os.fork()",
    "memory-bomb": "x = []\nwhile True:\n    x.append(bytearray(50 << 20))",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('pwned')",
    "write-outside": "open({outside!r}, 'w').write('x')\nprint('pwned')",
    "read-secret": "import os\nprint(os.environ.get('RLFABRIC_TEST_SECRET', 'none'))",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_sandbox_contains_attacks_through_the_service(
    client: RewardClient, server: dict[str, str], tmp_path: Path, attack: str
) -> None:
    """Each hostile program ends without a passing reward, its effect does not reach the host, and the
    service keeps serving. A program that fails its tests scores 0 with status OK: that is the signal
    that teaches the policy not to write it (a SCORER_ERROR would drop the sample instead)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    outside = tmp_path / "written-from-sandbox"
    code = ATTACKS[attack].format(port=listener.getsockname()[1], outside=str(outside))
    tests = [{"input": "", "output": "pwned\n" if attack != "read-secret" else "s3cret\n"}]
    [result] = client.score(
        [item(0, f"```python\n{code}\n```", tests=tests)],
        "code_exec",
        {"wall_s": 3.0, "cpu_s": 2, "memory_mb": 256, "max_processes": 16},
        item_timeout_s=30,
    )
    assert (result.status == "ok" and result.reward == 0.0) or result.status != "ok", result
    assert result.components.get("passed", 0.0) == 0.0
    assert not outside.exists()
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert_serving(server["address"])


def test_reflection_alone_is_enough_to_call_the_service(server: dict[str, str]) -> None:
    """A client with no generated stubs (grpcurl-style) discovers and calls Score via reflection."""
    with grpc.insecure_channel(server["address"]) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "rlfabric.v1.RewardService" in database.get_services()
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName("rlfabric.v1.RewardService")
        method = service.methods_by_name["Score"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.ParseDict(
            {
                "items": [{"id": "r", "completion": "Paris", "reference": "paris"}],
                "scorer": {"named": {"name": "exact_match"}},
            },
            request_cls(),
        )
        call = channel.unary_unary(
            "/rlfabric.v1.RewardService/Score",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        response = json_format.MessageToDict(call(request, timeout=10, metadata=AUTH))
    [result] = response["results"]
    assert result["reward"]["status"] == "REWARD_STATUS_OK"
    assert result["reward"]["value"] == 1.0


def test_list_scorers_describes_every_scorer(client: RewardClient) -> None:
    scorers = {s["name"]: s for s in client.list_scorers()}
    expected = {
        "exact_match", "regex", "math_verify", "length_penalty", "overlong_penalty",
        "reward_model", "llm_judge", "code_exec", "python_function", "composite",
    }  # fmt: skip
    assert expected <= set(scorers)
    regex_params = {p["name"]: p for p in scorers["regex"]["params"]}
    assert regex_params["pattern"]["required"] is True


async def test_async_client(server: dict[str, str]) -> None:
    async with AsyncRewardClient(server["address"], token=TOKEN) as client:
        results = await client.score([item(0, "Paris", "paris"), item(1, "Rome", "paris")], "exact_match")
        assert [r.reward for r in results] == [1.0, 0.0]
        assert len(await client.list_scorers()) >= 10


def test_prometheus_metrics_count_items_per_scorer(client: RewardClient, server: dict[str, str]) -> None:
    client.score([item(0, "a", "a"), item(1, "b", "a")], "exact_match")
    with urllib.request.urlopen(server["metrics"], timeout=5) as response:
        text = response.read().decode()
    assert re.search(r'rlfabric_reward_items_total\{scorer="exact_match",status="ok"\} [1-9]', text)
    assert 'rlfabric_reward_batch_seconds_bucket{le="0.01",scorer="exact_match"}' in text
    assert "rlfabric_grpc_server_handled_total" in text


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "via-server"])
def test_cli_scores_a_jsonl_file(tmp_path: Path, server: dict[str, str], remote: bool) -> None:
    rows = [
        item(0, "\\boxed{4}", "4", topic="add"),
        item(1, "\\boxed{5}", "4", topic="add"),
        item(2, "x", ""),
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    argv = ["reward", "score", "--input", str(source), "--output", str(out), "--scorer", "math_verify"]
    argv += ["--no-progress", *(["--server", server["address"]] if remote else ["--workers", "1"])]
    env = {**os.environ, "RLFABRIC_REWARD_TOKEN": TOKEN}  # the CLI's default for --token
    result = subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", *argv], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 1, "an item failed: non-zero without --allow-failures"
    assert "1 of 3 items failed to score" in result.stderr, result.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reward"] for r in scored] == [1.0, 0.0, None]
    assert [r["status"] for r in scored] == ["ok", "ok", "scorer_error"]
    assert scored[0]["topic"] == "add"
    assert "scored 3 items" in result.stdout and "1 scorer errors" in result.stdout
