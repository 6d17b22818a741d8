"""TRL's reward functions through the real reward service and `rlfabric reward score`, unchanged
(examples/trl_rewards.py and `trl.rewards`), and the CLI's one-line errors and exit statuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rlfabric.local.procs import ServiceProcess
from rlfabric.reward.client import RewardClient, RewardServiceError

TOKEN = "trl-suite-token"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TRL_FILE = EXAMPLES / "trl_rewards.py"
CHAT = [{"role": "user", "content": "What is 1/3?"}]


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A reward service allowed to load examples/ and `trl.rewards`."""
    logs = tmp_path_factory.mktemp("reward")
    allowed = json.dumps([str(EXAMPLES), "trl.rewards"])
    proc = ServiceProcess(
        "reward",
        [
            sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0", "--set", "workers=1",
            "--set", "server.metrics_port=0", "--set", "log.format=text",
            "--set", f"allowed_functions={allowed}",
        ],
        log_path=logs / "reward.log",
        env={**os.environ, "RLFABRIC_REWARD__TOKEN": TOKEN},
    )  # fmt: skip
    yield proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    assert proc.stop() == 0


def row(completion: Any, **columns: Any) -> dict[str, Any]:
    return {"prompt": CHAT, "completion": completion, **columns}


def trl_rows() -> list[dict[str, Any]]:
    """Conversational rows with a `solution` column and engine token ids."""
    return [
        row(r"<think>thirds</think> \boxed{\frac{1}{3}}", solution=r"\frac{1}{3}", completion_ids=[1] * 50),
        row([{"role": "assistant", "content": r"\boxed{\frac{1}{2}}"}], solution=r"\frac{1}{3}",
            completion_ids=[1] * 90),
        row(r"\boxed{1}", solution="no gold", completion_ids=[1] * 10),
    ]  # fmt: skip


TRL_SPEC = {
    "function": ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward",
                 f"{TRL_FILE}:soft_overlong_punishment"],
    "weights": [1.0, 0.5, 1.0],
}  # fmt: skip
EXPECTED = [(1.0 + 0.5 * 1.0 + 0.0, "ok"), (0.0 + 0.0 - 0.5, "ok"), (0.5 * 0.0 + 0.0, "ok")]
"""accuracy_reward's None for the third row (unparseable gold) is left out of the sum, as in TRL."""


def test_trl_functions_score_through_the_service(address: str) -> None:
    with RewardClient(address, timeout_s=60, token=TOKEN) as client:
        results = client.score(trl_rows(), "python_function", TRL_SPEC)
    assert [(r.reward, r.status) for r in results] == EXPECTED
    assert results[1].components["soft_overlong_punishment_reward"] == -0.5
    assert "accuracy_reward" not in results[2].components


def test_async_and_log_metric_through_the_service(address: str) -> None:
    spec = {"function": [f"{TRL_FILE}:async_reward_func", f"{TRL_FILE}:length_curriculum_reward"]}
    items = [{"completion": "x" * 20, "policy_version": 3}, {"completion": "", "policy_version": 3}]
    with RewardClient(address, timeout_s=60, token=TOKEN) as client:
        results = client.score(items, "python_function", spec)
    assert [r.reward for r in results] == [1.0, -1.0]
    assert results[0].components["length_curriculum_reward/mean_chars"] == 10.0


def test_the_client_names_the_refused_field(address: str) -> None:
    with RewardClient(address, timeout_s=60, token=TOKEN) as client, pytest.raises(RewardServiceError) as err:
        client.score([{"completion": "x"}], "no_such_scorer")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "no_such_scorer" in err.value.reason


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RLFABRIC_REWARD_TOKEN": TOKEN}
    command = [sys.executable, "-m", "rlfabric.cli", "reward", "score", "--no-progress", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "via-server"])
def test_trl_functions_score_through_the_cli(tmp_path: Path, address: str, remote: bool) -> None:
    source, out = write_jsonl(tmp_path / "in.jsonl", trl_rows()), tmp_path / "out.jsonl"
    where = ["--server", address] if remote else ["--workers", "1", "--allow-function", str(EXAMPLES)]
    where += [] if remote else ["--allow-function", "trl.rewards"]
    result = cli("--input", str(source), "--output", str(out), "--scorer", "python_function",
                 "--params", json.dumps(TRL_SPEC), *where)  # fmt: skip
    assert result.returncode == 0, result.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["reward"], r["status"]) for r in scored] == EXPECTED


def test_quickstart_reward_len_and_failure_exit_status(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"completion": "x" * 20}, {"completion": "abc"}])
    out = tmp_path / "out.jsonl"
    params = json.dumps({"function": f"{TRL_FILE}:reward_func"})  # needs a `ground_truth` column: fails
    args = ["--input", str(source), "--output", str(out), "--scorer", "python_function", "--workers", "1"]
    args += ["--allow-function", str(EXAMPLES)]
    failed = cli(*args, "--params", params)
    assert failed.returncode == 1 and "2 of 2 items failed to score" in failed.stderr, failed.stderr
    assert {json.loads(line)["status"] for line in out.read_text().splitlines()} == {"scorer_error"}
    assert cli(*args, "--params", params, "--allow-failures").returncode == 0
    ok = cli(*args, "--params", json.dumps({"function": f"{TRL_FILE}:reward_len"}))
    assert ok.returncode == 0, ok.stderr
    assert [json.loads(line)["reward"] for line in out.read_text().splitlines()] == [0.0, -17.0]


def one_line_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_cli_problems_are_one_line_before_scoring(tmp_path: Path, address: str) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [{"completion": "a"}])
    out = str(tmp_path / "out.jsonl")
    named = ("--scorer", "exact_match", "--workers", "1")
    one_line_error(
        cli("--input", str(tmp_path / "missing.jsonl"), "--output", out, *named), 2, "no such file"
    )
    unwritable = str(tmp_path / "no-dir" / "out.jsonl")
    one_line_error(
        cli("--input", str(good), "--output", unwritable, *named), 2, "--output: no such directory"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"completion": "a"}\n{"completion": \n{"completion": 3}\n')
    one_line_error(cli("--input", str(bad), "--output", out, *named), 2, f"{bad}:2: not valid JSON")
    bad.write_text('{"completion": "a"}\n\n{"completion": 3}\n')
    one_line_error(
        cli("--input", str(bad), "--output", out, *named), 2, f"{bad}:3: completion: expected a string"
    )
    one_line_error(
        cli("--input", str(good), "--output", out, "--scorer", "nope", "--workers", "1"), 2, "nope"
    )
    remote = ("--input", str(good), "--output", out, "--scorer", "nope", "--server", address)
    one_line_error(cli(*remote), 1, "answered INVALID_ARGUMENT")
    assert not Path(out).exists(), "nothing was scored, nothing written"
