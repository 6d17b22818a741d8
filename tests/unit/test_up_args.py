"""`rlfabric up`'s flags that shape the processes it starts, its tokens, `--resume`'s plan and the plot's
restart markers (no service is started here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlfabric.local import plot as up_plot
from rlfabric.local import stack as stack_mod
from rlfabric.local import up
from rlfabric.local.credentials import Credentials
from rlfabric.runspec import RunSpec


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_replica_cores_bind_each_replica_to_its_entry_in_turn(tmp_path: Path) -> None:
    args = parse("--replica-cores", "0|1-3", "--engine", "vllm")
    assert args.replica_cores == ["0", "1-3"]
    stack = stack_mod.Stack(tmp_path)
    spec = SimpleNamespace(
        name="r",
        output_dir=str(tmp_path),
        environment=None,
        model=SimpleNamespace(path="m", max_model_len=64, dtype="auto"),
    )
    binds = [
        stack_mod.replica_process(stack, args, spec, "redis://x", i).env["VLLM_CPU_OMP_THREADS_BIND"]
        for i in range(3)
    ]
    assert binds == ["0", "1-3", "0"]


def test_without_replica_cores_the_environment_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-3")
    args = parse("--engine", "vllm")
    spec = SimpleNamespace(
        name="r",
        output_dir=str(tmp_path),
        environment=None,
        model=SimpleNamespace(path="m", max_model_len=64, dtype="auto"),
    )
    proc = stack_mod.replica_process(stack_mod.Stack(tmp_path), args, spec, "redis://x", 0)
    assert proc.env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"


@pytest.mark.parametrize("text", ["", "0||1", "a", "0-x", "1;2"])
def test_malformed_replica_cores_are_refused(text: str) -> None:
    with pytest.raises(SystemExit):
        parse("--replica-cores", text)


def test_the_compile_cache_is_shared_by_runs_unless_the_caller_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No per-run VLLM_CACHE_ROOT: a replica compiled once for a model starts from the cache next time."""
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    assert "VLLM_CACHE_ROOT" not in stack_mod.vllm_env(compile_=True)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert stack_mod.vllm_env(compile_=True)["VLLM_CACHE_ROOT"] == str(tmp_path)


def test_launched_processes_start_together(tmp_path: Path) -> None:
    """`Stack.launch` does not wait: the first process is ready only once the second, launched after it,
    has run (it waits for a file the second writes), so a stack that waited in between would time out."""
    flag = tmp_path / "flag"
    first = [sys.executable, "-c", WAIT_FOR_FLAG, str(flag)]
    touch = "import sys, pathlib; pathlib.Path(sys.argv[1]).touch(); print('up')"
    second = [sys.executable, "-c", touch, str(flag)]
    stack = stack_mod.Stack(tmp_path)
    try:
        waiting = stack.launch(stack.process("first", first), r"ready (\d+)", timeout_s=60)
        writing = stack.launch(stack.process("second", second), r"up", timeout_s=60)
        assert stack.wait(waiting) == "1"
        assert stack.wait(writing) == ""
    finally:
        stack.stop()


WAIT_FOR_FLAG = """
import pathlib, sys, time
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.05)
print("ready 1", flush=True)
time.sleep(60)
"""


def test_each_service_process_gets_its_own_tokens_only(tmp_path: Path) -> None:
    credentials = Credentials.generate()
    stack = stack_mod.Stack(tmp_path, credentials)
    reward = stack_mod.reward_process(stack, parse(), spec_naming("pkg.mod:fn"))
    assert reward.env["RLFABRIC_REWARD__TOKEN"] == credentials.reward
    assert credentials.api not in reward.env.values() and credentials.weights not in reward.env.values()
    assert reward.guarded


def test_the_reward_service_allows_the_run_files_folder_and_the_specs_functions(
    tmp_path: Path,
) -> None:
    run_file = tmp_path / "runs" / "r.yaml"
    argv = stack_mod.reward_process(
        stack_mod.Stack(tmp_path), parse(str(run_file)), spec_naming("rewards.py:fn")
    ).argv
    assert f"allowed_functions={json.dumps([str(run_file.parent)])}" in argv
    demo = stack_mod.reward_process(stack_mod.Stack(tmp_path), parse(), spec_naming("pkg.mod:fn")).argv
    assert f"allowed_functions={json.dumps(['pkg.mod:fn'])}" in demo


def spec_naming(function: str) -> RunSpec:
    reward = {"scorer": "python_function", "params": {"function": function}}
    return RunSpec.model_validate({"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}, "reward": reward})


def test_a_used_run_directory_needs_resume(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_file, data = tmp_path / "run.yaml", tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')
    run = {"name": "r", "model": {"path": str(tiny_model_dir)}, "dataset": {"path": str(data)}}
    run_file.write_text(yaml.safe_dump(run))
    first = up.plan(
        parse(str(run_file), "--run-dir", str(tmp_path / "d"), "--steps", "7", "--engine", "transformers")
    )
    assert not first.resume and (tmp_path / "d" / up.STATE_FILE).exists()
    with pytest.raises(ValueError, match="--resume"):
        up.plan(parse(str(run_file), "--run-dir", str(tmp_path / "d")))
    with pytest.raises(ValueError, match="neither a run file"):
        up.plan(parse(str(run_file), "--resume", str(tmp_path / "d")))
    resumed = up.plan(parse("--resume", str(tmp_path / "d"), "--no-progress"))
    assert resumed.resume and resumed.spec == first.spec and resumed.spec.train.steps == 7
    assert resumed.args.engine == "transformers" and resumed.args.no_progress
    with pytest.raises(ValueError, match=r"holds no up\.json"):
        up.plan(parse("--resume", str(tmp_path)))


def test_a_run_that_cannot_run_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_file = tmp_path / "run.yaml"
    run = {"model": {"path": str(tmp_path / "m")}, "dataset": {"path": str(tmp_path / "d.jsonl")}}
    run_file.write_text(yaml.safe_dump({**run, "reward": {"scorer": "exact_matc"}}))
    assert up.run(parse(str(run_file), "--run-dir", str(tmp_path / "d"))) == 2
    err = capsys.readouterr().err
    for field in ("reward.scorer", "model.path", "dataset.path"):
        assert f"{field}: " in err
    assert not (tmp_path / "d" / up.STATE_FILE).exists()


RESTARTED = [
    {"step": 1, "reward_mean": 0.1},
    {"step": 2, "reward_mean": 0.2},
    {"step": 3, "reward_mean": 0.3},
    {"step": 2, "event": "learner_restart", "restored_step": 2, "policy_version": 2, "time": 0.0},
    {"step": 3, "reward_mean": 0.35},
]


def test_curves_are_not_joined_across_a_learner_restart() -> None:
    assert up_plot.restart_steps(RESTARTED) == [2]
    assert up_plot.segments(RESTARTED, "reward_mean") == [[(1, 0.1), (2, 0.2), (3, 0.3)], [(3, 0.35)]]
    assert up_plot.segments(RESTARTED, "kl") == []


def test_the_plot_marks_a_learner_restart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in RESTARTED))
    assert up_plot.plot(metrics, tmp_path / "curves.png") == tmp_path / "curves.png"
    assert (tmp_path / "curves.png").stat().st_size > 0
