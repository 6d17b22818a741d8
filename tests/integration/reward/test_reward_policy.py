"""The operator's policy at the reward service's port: user code only from `allowed_functions`, sandbox
limits that requests may only tighten, and limits named in the status message when a program hits one.

A real `rlfabric serve reward` process with one scorer worker, called over gRPC. Each refused reference
is a module or file whose import would write a marker file, so a refusal that came after the import (in
the server process or in its worker) fails the test.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rlfabric.local.procs import ServiceProcess
from rlfabric.runtime.sandbox import probe_isolation
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc

TRAP = """
open({marker!r}, "a").write("imported\\n")

def reward(prompts, completions, **kwargs):
    return [1.0] * len(completions)
"""
GOOD = """
def reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]
"""
SERVER_CPU_S = 2
SERVER_MEMORY_MB = 256
needs_isolation = pytest.mark.skipif(probe_isolation().mode == "none", reason="no sandbox isolation here")


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """allowed/ (good.py, a symlink out), outside/trap.py, and mods/trapmod.py on the server's path;
    every trap writes `marker` when imported."""
    root = tmp_path_factory.mktemp("policy")
    marker = root / "imported"
    for sub in ("allowed", "outside", "mods"):
        (root / sub).mkdir()
    (root / "allowed" / "good.py").write_text(GOOD)
    (root / "outside" / "trap.py").write_text(TRAP.format(marker=str(marker)))
    (root / "mods" / "trapmod.py").write_text(TRAP.format(marker=str(marker)))
    (root / "allowed" / "link.py").symlink_to(root / "outside" / "trap.py")
    return {"root": root, "marker": marker, "touched": root / "touched-by-pty"}


@pytest.fixture(scope="module")
def address(places: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    allowed = json.dumps([str(places["root"] / "allowed"), "trapmod_allowed_prefix"])
    proc = ServiceProcess(
        "reward",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0", "--set", "workers=1",
            "--set", "insecure=true", "--set", "log.format=text", "--set", f"allowed_functions={allowed}",
            "--set", f"sandbox.cpu_s={SERVER_CPU_S}", "--set", f"sandbox.memory_mb={SERVER_MEMORY_MB}",
            "--set", "sandbox.max_processes=16", "--set", "sandbox.wall_s=30",
        ],
        log_path=tmp_path_factory.mktemp("logs") / "reward.log",
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(places["root"] / "mods"), *sys.path])},
    )  # fmt: skip
    address = proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    yield address
    assert proc.stop() == 0


def score(address: str, name: str, params: dict[str, object], completions: list[str], **meta: object) -> Any:
    """One Score call; returns the response or the RpcError."""
    spec = reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name=name))
    spec.named.params.update(params)
    items = [
        reward_pb2.ScoreItem(id=str(i), prompt=common_pb2.Prompt(text=c), completion=c, metadata=meta or None)
        for i, c in enumerate(completions)
    ]
    with grpc.insecure_channel(address) as channel:
        try:
            return reward_pb2_grpc.RewardServiceStub(channel).Score(
                reward_pb2.ScoreRequest(items=items, scorer=spec), timeout=60
            )
        except grpc.RpcError as error:
            return error


def refused(address: str, name: str, params: dict[str, object], completions: list[str]) -> str:
    error = score(address, name, params, completions)
    assert isinstance(error, grpc.RpcError), f"accepted: {error}"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    return error.details() or ""


def test_the_pty_spawn_attack_is_refused_and_runs_nothing(address: str, places: dict[str, Path]) -> None:
    """The reported attack: `pty:spawn` called with the prompts as argv ran `touch` as the service."""
    details = refused(
        address, "python_function", {"function": "pty:spawn"}, ["touch", str(places["touched"])]
    )
    assert "scorer.params.function" in details and "not in allowed_functions" in details
    assert not places["touched"].exists()


@pytest.mark.parametrize(
    "function",
    [
        "os:system",
        "subprocess:run",
        "builtins:exec",
        "trapmod:reward",  # importable by the server, not allowed
        "{root}/outside/trap.py:reward",
        "{root}/allowed/../outside/trap.py:reward",
        "{root}/allowed/link.py:reward",  # a symlink in the allowed directory pointing out of it
        "{root}/allowed/good.py:reward.__globals__",
    ],
)
def test_references_outside_the_allowlist_are_refused_before_any_import(
    address: str, places: dict[str, Path], function: str
) -> None:
    spec = {"function": function.format(root=places["root"])}
    details = refused(address, "python_function", spec, ["x"])
    assert "scorer.params.function" in details
    assert not places["marker"].exists(), "a refused module ran its import-time code"
    composite = {"parts": [{"alias": "u", "scorer": "python_function", "params": spec}]}
    assert "parts[0].params.function" in refused(address, "composite", composite, ["x"])
    assert not places["marker"].exists()


def test_an_allowed_file_scores_in_the_worker(address: str, places: dict[str, Path]) -> None:
    response = score(
        address, "python_function", {"function": f"{places['root']}/allowed/good.py:reward"}, ["ab"]
    )
    assert not isinstance(response, grpc.RpcError), response
    [result] = response.results
    assert (result.reward.status, result.reward.value) == (common_pb2.REWARD_STATUS_OK, 2.0)


def test_the_worker_enforces_the_allowlist_itself(places: dict[str, Path]) -> None:
    """A job that reaches a worker directly (not through the server's check) is refused there too."""
    header = struct.Struct(">I")

    def frame(payload: dict[str, object]) -> bytes:
        data = json.dumps(payload).encode()
        return header.pack(len(data)) + data

    policy = {"allowed_functions": [str(places["root"] / "allowed")], "sandbox": {}}
    job = {"spec": {"name": "python_function", "params": {"function": "pty:spawn"}}, "timeout_s": 10}
    job["items"] = [{"id": "0", "prompt": "touch", "completion": str(places["touched"]), "reference": "",
                     "metadata": {}}]  # fmt: skip
    worker = subprocess.run(
        [sys.executable, "-m", "rlfabric.reward.worker"],
        input=frame(policy) + frame(job),
        capture_output=True,
        timeout=60,
        check=True,
    )
    answers = []
    out = worker.stdout
    while out:
        (size,) = header.unpack(out[: header.size])
        answers.append(json.loads(out[header.size : header.size + size]))
        out = out[header.size + size :]
    assert answers[0] == {"ready": True}
    assert "not in allowed_functions" in answers[1]["error"]
    assert not places["touched"].exists()


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (
            {"cpu_s": 10},
            f"scorer.params.cpu_s: 10 exceeds the server's limit (sandbox.cpu_s = {SERVER_CPU_S})",
        ),
        ({"memory_mb": 4096}, f"(sandbox.memory_mb = {SERVER_MEMORY_MB})"),
        ({"max_processes": 1000}, "(sandbox.max_processes = 16)"),
        ({"allow_unisolated": True}, "scorer.params.allow_unisolated"),
    ],
)
def test_a_request_cannot_loosen_the_sandbox(address: str, params: dict[str, object], fragment: str) -> None:
    assert fragment in refused(address, "code_exec", params, ["print(1)"])


@needs_isolation
@pytest.mark.parametrize(
    ("code", "params", "message"),
    [
        ("while True:\n    pass", {}, f"test 0: cpu time limit ({SERVER_CPU_S} s) exceeded"),
        (
            "x = []\nwhile True:\n    x.append(bytearray(50 << 20))",
            {},
            f"memory limit ({SERVER_MEMORY_MB} MB) exceeded",
        ),
        ("import time\ntime.sleep(60)", {"wall_s": 2}, "wall time limit (2 s) exceeded"),
        ("import os\nwhile True:\n    os.fork()", {}, "process limit (16) reached"),
    ],
    ids=["cpu", "memory", "wall", "processes"],
)
def test_a_program_that_hits_a_limit_is_told_which(
    address: str, code: str, params: dict[str, object], message: str
) -> None:
    """The server's limits apply when the request sets none (cpu, memory, processes); a request's own
    tighter limit applies when it sets one (wall)."""
    tests = [{"input": "", "output": "done\n"}]
    response = score(address, "code_exec", params, [f"```python\n{code}\n```"], tests=tests)
    assert not isinstance(response, grpc.RpcError), response
    [result] = response.results
    assert result.reward.status == common_pb2.REWARD_STATUS_OK and result.reward.value == 0.0
    assert message in result.reward.message


def test_in_process_cli_scoring_needs_an_allow_function_too(places: dict[str, Path], tmp_path: Path) -> None:
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "q", "completion": "abc"}) + "\n")
    params = json.dumps({"function": f"{places['root']}/allowed/good.py:reward"})
    argv = [sys.executable, "-m", "rlfabric.cli", "reward", "score", "--input", str(rows), "--output",
            str(tmp_path / "out.jsonl"), "--scorer", "python_function", "--params", params, "--workers", "1",
            "--no-progress"]  # fmt: skip
    denied = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert denied.returncode == 2 and "not in allowed_functions" in denied.stderr, denied.stderr
    allow = ["--allow-function", str(places["root"] / "allowed")]
    allowed = subprocess.run([*argv, *allow], capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["reward"] == 3.0
