"""`rlfabric up` with several runs on one shared rollout fleet: run files or `--runs K`, what they refuse
before anything starts, the fleet's replicas, learners and reward service, watching the runs and scaling
the fleet by its summed signal (no service is started here)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from up_cli import parse

from rlfabric.local import replicas as replicas_mod
from rlfabric.local import services, up
from rlfabric.local import stack as stack_mod
from rlfabric.local.scaler import ScaleEvent, ScalePolicy
from rlfabric.runspec import RunSpec


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
