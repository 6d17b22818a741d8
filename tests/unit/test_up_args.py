"""`rlfabric up`'s flags that shape the processes it starts, its tokens and `--resume`'s plan (no service
is started here)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from rlfabric.local import replicas as replicas_mod
from rlfabric.local import services, up, up_args
from rlfabric.local import stack as stack_mod
from rlfabric.local.credentials import Credentials
from rlfabric.local.scaler import ScaleEvent, ScalePolicy
from rlfabric.runspec import RunSpec


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up_args.add_arguments(parser)
    return parser.parse_args(list(argv))


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


def test_learner_cores_confine_each_learner_with_a_torch_thread_per_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Learner i takes entry i modulo their count, through its guard; without the flag a learner may run
    anywhere with one torch thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    runs = fleet_runs(tmp_path, (8, 8, 8), ("pkg.a:f", "pkg.a:f", "pkg.a:f"))
    stack = stack_mod.Stack(tmp_path)
    args = parse("--learner-cores", "1|2-3")
    learners = [services.fleet_learner(stack, args, run.spec, "redis://x", i) for i, run in enumerate(runs)]
    assert [(p.cpus, p.env["OMP_NUM_THREADS"]) for p in learners] == [("1", "1"), ("2-3", "2"), ("1", "1")]
    assert all(p.command()[p.command().index("--cpus") + 1] == p.cpus for p in learners)
    # learners of one entry take turns to train (one lock file per entry)
    locks = [yaml.safe_load((tmp_path / f"{run.spec.name}.learner.yaml").read_text()) for run in runs]
    assert [c["compute_lock"] for c in locks] == [
        str(tmp_path / "learner-cores-1.lock"), str(tmp_path / "learner-cores-2-3.lock"),
        str(tmp_path / "learner-cores-1.lock"),
    ]  # fmt: skip
    alone = services.learner_process(stack, parse(), runs[0].spec, "redis://x")
    assert (alone.cpus, alone.env["OMP_NUM_THREADS"]) == (None, "1") and "--cpus" not in alone.command()
    assert "compute_lock" not in yaml.safe_load((tmp_path / "learner.yaml").read_text())


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


# --- several runs on one shared fleet ---------------------------------------------------------------------


def test_run_files_one_none_or_several() -> None:
    assert (parse().run_file, parse().run_files) == (None, [])
    assert (parse("a.toml").run_file, parse("a.toml").run_files) == ("a.toml", ["a.toml"])
    several = parse("a.toml", "b.yaml", "--steps", "3")
    assert (several.run_file, several.run_files, several.steps) == (None, ["a.toml", "b.yaml"], 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--runs", "2"], "model.lora: the demo trains no LoRA adapter"),
        (["--runs", "1", "--lora", "8"], "--runs needs 2 or more"),
        (["--runs", "2", "--lora", "8", "r.toml"], "give run files or --runs, not both"),
        (["--runs", "2", "--lora", "8", "--replicas", "3", "--max-replicas", "2"], "must lie within"),
        (["--resume", "d", "--runs", "2"], "--resume takes no run file, --runs, --run-dir or --set"),
    ],
)
def test_several_runs_refuse_what_they_cannot_do_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    run_dir = tmp_path / "d"
    assert up.run(parse(*argv, "--run-dir", str(run_dir)) if "--resume" not in argv else parse(*argv)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists()


def test_runs_k_are_the_demo_k_times_on_the_local_fleet(tmp_path: Path) -> None:
    argv = ["--runs", "2", "--lora", "8", "--steps", "3", "--max-replicas", "2"]
    chosen = up.plan(parse(*argv, "--run-dir", str(tmp_path / "d")))
    assert up.scale_policy(chosen.args) == ScalePolicy(1, 2, 10.0, 60.0)
    specs = [run.spec for run in chosen.runs]
    assert [s.name for s in specs] == ["demo-1", "demo-2"] and chosen.spec is specs[0]
    assert [s.dataset.shuffle_seed for s in specs] == [0, 1]
    assert {s.rollout.fleet for s in specs} == {up.LOCAL_FLEET}
    assert {s.model.path for s in specs} == {str(tmp_path / "d" / "model")}
    assert all(s.model.published_adapter.rank == 8 and s.train.steps == 3 for s in specs)
    assert [s.weights.url for s in specs] == [
        str(tmp_path / "d" / n / "weights") for n in ("demo-1", "demo-2")
    ]
    state = json.loads((tmp_path / "d" / up.STATE_FILE).read_text())
    assert [s["name"] for s in state[up.FLEET_STATE]] == ["demo-1", "demo-2"]
    resumed = up.plan(parse("--resume", str(tmp_path / "d"), "--no-progress"))
    assert resumed.resume and [run.spec for run in resumed.runs] == specs and resumed.spec == specs[0]
    assert resumed.args.max_replicas == 2 and resumed.args.lora == 8 and resumed.args.no_progress


@pytest.fixture
def run_file(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., str]:
    """Writes a run file on the tiny model and a one-row dataset: `lora` (rank) and `fleet` set those
    fields, `model` another model path."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')

    def write(
        name: str, *, lora: int | None = None, fleet: str | None = None, model: Path | None = None
    ) -> str:
        spec: dict[str, Any] = {"name": name, "dataset": {"path": str(data)}}
        spec["model"] = {"path": str(model or tiny_model_dir)}
        if lora is not None:
            spec["model"]["lora"] = {"rank": lora, "alpha": 2 * lora}
        if fleet is not None:
            spec["rollout"] = {"fleet": fleet}
        path = tmp_path / f"{name}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return str(path)

    return write


def test_run_files_keep_their_fleet_and_their_own_lora(tmp_path: Path, run_file: Callable[..., str]) -> None:
    first, second = run_file("a", lora=20, fleet="shared"), run_file("b", lora=20)
    chosen = up.plan(parse(first, second, "--run-dir", str(tmp_path / "d")))
    names = [(r.spec.name, r.spec.rollout.fleet, r.run_file) for r in chosen.runs]
    assert names == [("a", "shared", first), ("b", "shared", second)]
    assert all(r.spec.model.published_adapter.rank == 20 for r in chosen.runs)
    assert up.plan(parse(first, run_file("c"), "--lora", "8", "--run-dir", str(tmp_path / "e"))).runs
    resumed = up.plan(parse("--resume", str(tmp_path / "d")))  # each run keeps its file (its folder's code)
    expected = [(r.spec, str(Path(r.run_file or "").resolve())) for r in chosen.runs]
    assert [(r.spec, r.run_file) for r in resumed.runs] == expected


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"name": "b"}, "model.lora: run b trains no LoRA adapter"),
        ({"name": "a", "lora": 8}, "name: runs sharing a fleet need a different name each"),
        ({"name": "b", "lora": 8, "model": "other"}, "model.path: runs sharing a fleet need the same"),
        ({"name": "b", "lora": 8, "fleet": "f2"}, "rollout.fleet: the runs name different fleets (f1, f2)"),
    ],
)
def test_run_files_that_cannot_share_a_fleet_are_refused_naming_the_field(
    tmp_path: Path, run_file: Callable[..., str], second: dict[str, Any], message: str
) -> None:
    if "model" in second:
        second["model"] = tmp_path / second["model"]
        second["model"].mkdir()
    first = run_file("a", lora=8, fleet="f1")
    with pytest.raises(ValueError, match=re.escape(message)):
        up.plan(parse(first, run_file(**second), "--run-dir", str(tmp_path / "d")))


def fleet_runs(
    tmp_path: Path, ranks: tuple[int, ...], functions: tuple[str, ...]
) -> list[stack_mod.FleetRun]:
    runs = []
    for i, (rank, function) in enumerate(zip(ranks, functions, strict=True)):
        spec = RunSpec.model_validate(
            {
                "name": f"r{i}",
                "output_dir": str(tmp_path),
                "model": {"path": "m", "max_model_len": 64 * (i + 1), "lora": {"rank": rank, "alpha": rank}},
                "dataset": {"path": "d.jsonl"},
                "reward": {"scorer": "python_function", "params": {"function": function}},
                "rollout": {"fleet": "local"},
            }
        )
        runs.append(stack_mod.FleetRun(spec, None))
    return runs


def settings(argv: list[str]) -> dict[str, str]:
    pairs = [argv[i + 1].split("=", 1) for i, arg in enumerate(argv) if arg == "--set"]
    return {key: value for key, value in pairs}


def test_a_fleet_replica_follows_the_fleet_with_a_slot_per_run_at_the_largest_rank(tmp_path: Path) -> None:
    runs = fleet_runs(tmp_path, (8, 20, 16), ("pkg.a:f", "pkg.b:f", "pkg.a:f"))
    proc = replicas_mod.fleet_replica_process(stack_mod.Stack(tmp_path), parse(), runs, "redis://x", 0)
    got = settings(proc.argv)
    assert got["fleet"] == "local" and "run_id" not in got and "weights_root" not in got
    assert (got["engine.max_adapters"], got["engine.max_adapter_rank"]) == ("3", "32")
    assert got["engine.max_model_len"] == "192" and got["replica_id"] == "rollout-0"


def test_each_run_of_a_fleet_has_its_own_learner_and_the_reward_service_allows_all_functions(
    tmp_path: Path,
) -> None:
    runs = fleet_runs(tmp_path, (8, 8), ("pkg.a:f", "pkg.b:g"))
    stack = stack_mod.Stack(tmp_path)
    learners = [services.fleet_learner(stack, parse(), r.spec, "redis://x", i) for i, r in enumerate(runs)]
    assert [proc.name for proc in learners] == ["learner-r0", "learner-r1"]
    for run in runs:
        config = yaml.safe_load((tmp_path / f"{run.spec.name}.learner.yaml").read_text())
        assert config["run_id"] == run.spec.name and config["run"]["rollout"]["fleet"] == "local"
    assert services.fleet_allowed_functions(runs) == ["pkg.a:f", "pkg.b:g"]


class ScriptedApi:
    """The coordinator's answers, per run, one status per look (the last repeated)."""

    def __init__(self, script: dict[str, list[dict[str, object]]]) -> None:
        self.script, self.stopped = script, []  # type: list[str]

    def status(self, run_id: str) -> dict[str, object]:
        answers = self.script[run_id]
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def stop(self, run_id: str) -> None:
        self.stopped.append(run_id)


def test_watching_several_runs_prints_each_runs_steps_until_all_end(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlfabric.local import watch

    monkeypatch.setattr(watch.time, "sleep", lambda s: None)
    metrics = {"latest_metrics": {"reward_mean": 0.5}}
    api = ScriptedApi(
        {
            "a": [{"state": "running", "step": 1, **metrics}, {"state": "completed", "step": 2, **metrics}],
            "b": [
                {"state": "running", "step": 1},
                {"state": "running", "step": 1},
                {"state": "failed", "step": 2},
            ],
        }
    )
    supervisor = SimpleNamespace(poll=lambda: None, gave_up=None)
    statuses = watch.watch_runs(api, ["a", "b"], supervisor=supervisor)  # type: ignore[arg-type]
    assert {run: status["state"] for run, status in statuses.items()} == {"a": "completed", "b": "failed"}
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["a step 1: reward_mean=0.5", "b step 1: ", "a step 2: reward_mean=0.5", "b step 2: "]


class ScriptedSignal:
    """The fleet's desired replica counts, one per reading (a Redis error where the script says so)."""

    def __init__(self, readings: list[int | Exception | None]) -> None:
        self.readings = readings

    def desired(self) -> int | None:
        reading = self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]
        if isinstance(reading, Exception):
            raise reading
        return reading


def test_several_runs_scale_the_fleet_by_its_summed_signal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The scaler sees the fleet's readings in order; a reading Redis could not give is skipped."""
    import redis as redis_mod

    from rlfabric.local import watch

    monkeypatch.setattr(watch.time, "sleep", lambda s: None)
    running = {"state": "running", "step": 0}
    api = ScriptedApi({"a": [running, running, running, {"state": "completed", "step": 1}]})
    seen: list[int | None] = []

    def observe(desired: int | None, now: float) -> ScaleEvent | None:
        seen.append(desired)
        return ScaleEvent(now, "out", "rollout-1", 2, 1) if desired == 2 else None

    signal = ScriptedSignal([None, redis_mod.ConnectionError("restarting"), 2, 2])
    supervisor = SimpleNamespace(poll=lambda: None, gave_up=None)
    statuses = watch.watch_runs(
        api,  # type: ignore[arg-type]
        ["a"],
        supervisor=supervisor,  # type: ignore[arg-type]
        scaler=SimpleNamespace(observe=observe),  # type: ignore[arg-type]
        signal=signal,  # type: ignore[arg-type]
    )
    assert statuses["a"]["state"] == "completed"
    assert seen == [None, 2, 2]
    assert capsys.readouterr().out.count("autoscale: adding rollout-1 (1 running, 2 wanted)") == 2


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
