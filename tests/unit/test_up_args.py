"""`rlfabric up`'s flags that shape the processes it starts, its tokens and `--resume`'s plan (no service
is started here)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from up_cli import parse

from rlfabric.local import replicas as replicas_mod
from rlfabric.local import services, up
from rlfabric.local import stack as stack_mod
from rlfabric.local.credentials import Credentials
from rlfabric.runspec import RunSpec


def replica_spec(tmp_path: Path) -> RunSpec:
    """A run whose replicas the tests start (model "m", outputs under `tmp_path`)."""
    return RunSpec.model_validate({
        "name": "r", "output_dir": str(tmp_path), "model": {"path": "m", "max_model_len": 64},
        "dataset": {"path": "d.jsonl"},
    })  # fmt: skip


def test_replica_cores_bind_each_replica_to_its_entry_in_turn(tmp_path: Path) -> None:
    args = parse("--replica-cores", "0|1-3", "--engine", "vllm")
    assert args.replica_cores == ["0", "1-3"]
    stack = stack_mod.Stack(tmp_path)
    spec = replica_spec(tmp_path)
    replicas = [replicas_mod.replica_process(stack, args, spec, "redis://x", i) for i in range(3)]
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in replicas] == ["0", "1-3", "0"]
    # the whole replica (front end, engine core) on its cores too, through its guard
    assert [p.cpus for p in replicas] == ["0", "1-3", "0"]
    assert all(p.command()[p.command().index("--cpus") + 1] == p.cpus for p in replicas)


def test_without_replica_cores_the_environment_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-3")
    args = parse("--engine", "vllm")
    spec = replica_spec(tmp_path)
    proc = replicas_mod.replica_process(stack_mod.Stack(tmp_path), args, spec, "redis://x", 0)
    assert proc.env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert proc.cpus is None and "--cpus" not in proc.command()


@pytest.mark.parametrize("text", ["", "0||1", "a", "0-x", "1;2", "3-1", "1-2-3"])
@pytest.mark.parametrize("flag", ["--replica-cores", "--learner-cores"])
def test_malformed_core_lists_are_refused(flag: str, text: str) -> None:
    with pytest.raises(SystemExit):
        parse(flag, text)


def test_a_learner_alone_takes_every_core_one_beside_replicas_and_the_flag_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner with nothing beside it (an offline preference run's; a warm start's, an SFT or
    reward-model run file's: `learner_env` with the cores it may use) takes a torch thread per core this
    process may use, shared by its ranks; OMP_NUM_THREADS from the environment comes before any default;
    --learner-threads before everything."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = replica_spec(tmp_path)
    stack = stack_mod.Stack(tmp_path)
    cores = len(os.sched_getaffinity(0))

    def threads(*argv: str, alone: bool = False) -> str:
        proc = services.learner_process(stack, parse(*argv), spec, "redis://x", alone=alone)
        return proc.env["OMP_NUM_THREADS"]

    assert threads() == "1" and threads(alone=True) == str(cores)
    assert threads("--learner-ranks", "2", alone=True) == str(max(1, cores // 2))
    assert threads("--learner-cores", "0-3", alone=True) == "4"  # its cores, not the machine's
    assert threads("--learner-threads", "3") == threads("--learner-threads", "3", alone=True) == "3"
    assert services.learner_env(parse(), 0)["OMP_NUM_THREADS"] == "1"  # at least one
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert threads() == threads(alone=True) == threads("--learner-cores", "0-3") == "6"
    assert threads("--learner-threads", "2", "--learner-cores", "0-3") == "2"
    assert services.learner_env(parse("--learner-threads", "5"), 1)["OMP_NUM_THREADS"] == "5"


@pytest.mark.parametrize("text", ["0", "-1", "x", "1025"])
def test_learner_threads_out_of_range_are_refused(text: str) -> None:
    with pytest.raises(SystemExit):
        parse("--learner-threads", text)


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
    reward = services.reward_process(stack, parse(), spec_naming("pkg.mod:fn"))
    assert reward.env["RLFABRIC_REWARD__TOKEN"] == credentials.reward
    assert credentials.api not in reward.env.values() and credentials.weights not in reward.env.values()
    assert reward.guarded


def test_the_reward_service_allows_the_run_files_folder_and_the_specs_functions(
    tmp_path: Path,
) -> None:
    run_file = tmp_path / "runs" / "r.yaml"
    argv = services.reward_process(
        stack_mod.Stack(tmp_path), parse(str(run_file)), spec_naming("rewards.py:fn")
    ).argv
    assert f"allowed_functions={json.dumps([str(run_file.parent)])}" in argv
    demo = services.reward_process(stack_mod.Stack(tmp_path), parse(), spec_naming("pkg.mod:fn")).argv
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
    with pytest.raises(ValueError, match="takes no run file"):
        up.plan(parse(str(run_file), "--resume", str(tmp_path / "d")))
    resumed = up.plan(parse("--resume", str(tmp_path / "d"), "--no-progress"))
    assert resumed.resume and resumed.spec == first.spec and resumed.spec.train.steps == 7
    assert resumed.args.engine == "transformers" and resumed.args.no_progress
    with pytest.raises(ValueError, match=r"holds no up\.json"):
        up.plan(parse("--resume", str(tmp_path)))


def test_set_overrides_keys_of_the_run_file_or_the_demo_and_resume_keeps_them(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_file, data = tmp_path / "run.json", tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')
    run = {"model": {"path": str(tiny_model_dir)}, "dataset": {"path": str(data)}, "optim": {"lr": 1e-5}}
    run_file.write_text(json.dumps(run))
    sets = ["optim.lr=1e-3", "rollout.sampling.stop=['.']"]
    overrides = ("--set", sets[0], "--set", sets[1], "--steps", "4")
    first = up.plan(parse(str(run_file), "--run-dir", str(tmp_path / "d"), *overrides))
    assert (first.spec.optim.lr, first.spec.rollout.sampling.stop, first.spec.train.steps) == (1e-3, ["."], 4)
    resumed = up.plan(parse("--resume", str(tmp_path / "d")))
    assert resumed.spec == first.spec and resumed.args.overrides == sets
    with pytest.raises(ValueError, match="--set"):
        up.plan(parse("--resume", str(tmp_path / "d"), "--set", "optim.lr=1"))
    demo = up.load_spec(parse("--set", "optim.lr=0.5", "--set", "train.steps=3"), tmp_path)
    assert (demo.name, demo.optim.lr, demo.train.steps) == ("demo", 0.5, 3)
    assert up.run(parse(str(run_file), "--run-dir", str(tmp_path / "e"), "--set", "optim.lr=-1")) == 2
    err = capsys.readouterr().err
    assert "(--set optim.lr)" in err and "optim.lr: Input should be greater" in err
    assert up.run(parse("--run-dir", str(tmp_path / "f"), "--set", "optim.lrr=1")) == 2
    assert "optim.lrr: Extra inputs are not permitted" in capsys.readouterr().err


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


def test_replicas_follow_the_weights_root_the_learner_publishes_to(tmp_path: Path) -> None:
    """The default root, or the run file's `weights.url` (where the learner publishes, `RunPaths`)."""
    args = parse("--engine", "vllm")
    spec = replica_spec(tmp_path)
    default = replicas_mod.replica_process(stack_mod.Stack(tmp_path), args, spec, "redis://x", 0)
    assert f"weights_root={tmp_path / 'r' / 'weights'}" in default.argv
    spec = spec.model_copy(update={"weights": spec.weights.model_copy(update={"url": str(tmp_path / "w")})})
    named = replicas_mod.replica_process(stack_mod.Stack(tmp_path), args, spec, "redis://x", 0)
    assert f"weights_root={tmp_path / 'w'}" in named.argv


def test_replica_max_in_flight_sets_every_replicas_capacity(tmp_path: Path) -> None:
    """On a fleet it is the slots the fair share hands out (what the replica registers as capacity)."""
    spec = replica_spec(tmp_path)
    args = parse("--replica-max-in-flight", "16", "--engine", "vllm")
    argv = replicas_mod.replica_process(stack_mod.Stack(tmp_path), args, spec, "redis://x", 0).argv
    assert "max_in_flight=16" in argv
    default = replicas_mod.replica_process(stack_mod.Stack(tmp_path), parse(), spec, "redis://x", 0).argv
    assert not any(a.startswith("max_in_flight=") for a in default)


@pytest.mark.parametrize("text", ["0", "-1", "x", ""])
def test_a_replica_max_in_flight_below_one_is_refused(text: str) -> None:
    with pytest.raises(SystemExit):
        parse("--replica-max-in-flight", text)


def test_the_api_token_is_printed_to_a_terminal_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    api = SimpleNamespace(url="http://127.0.0.1:1", token="s3cret-token", submit=lambda spec: "r")
    up.announce(api, SimpleNamespace(name="r"), tmp_path, submit=True)
    out = capsys.readouterr().out
    assert "s3cret-token" not in out and f"API token: in {tmp_path / 'credentials.json'}" in out
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    up.announce(api, SimpleNamespace(name="r"), tmp_path, submit=True)
    assert "mode 0600): s3cret-token" in capsys.readouterr().out
