"""`rlfabric plan`: the text and JSON plans of the example run files (their models' config.json only),
the verdict and exit code, suggestions that are re-planned, the placement per device, throughput from
measured costs or FLOPs, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlfabric.cli import main
from rlfabric.plan.planner import Inputs, load_models, make_plan, throughput
from rlfabric.plan.report import SCHEMA
from rlfabric.plan.resources import ResourcesSpec
from rlfabric.runspec import RewardSpec, RunSpec
from rlfabric.runtime.config import load_config

REPO = Path(__file__).resolve().parents[2]
FITS = "examples/plan/qwen7b-grpo.toml"
SHORT = "examples/plan/llama8b-ppo-one-gpu.toml"


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["plan", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_plan_that_fits_exits_0_with_every_line_and_its_formula(capsys: pytest.CaptureFixture[str]) -> None:
    code, plan = plan_json(capsys, FITS)
    assert code == 0 and plan["schema"] == SCHEMA and plan["fits"] is True
    assert [(d["name"], d["count"]) for d in plan["devices"]] == [("learner 0-3", 4), ("rollout 0-3", 4)]
    learner = plan["devices"][0]
    assert [r["role"] for r in learner["roles"]] == ["policy", "reference"]
    names = {line["name"] for line in learner["roles"][0]["lines"]}
    assert {"weights", "gradients", "optimizer states", "activations", "logits buffers"} <= names
    assert "kv cache" in {line["name"] for line in plan["devices"][1]["roles"][0]["lines"]}
    for device in plan["devices"]:
        assert device["total_bytes"] == sum(r["total_bytes"] for r in device["roles"])
        assert device["headroom_bytes"] == device["memory_bytes"] - device["total_bytes"]
        assert all(line["formula"] for role in device["roles"] for line in role["lines"])
    assert plan["suggestions"] == []
    assert {t["role"] for t in plan["throughput"]} == {"learner", "rollout"}
    assert plan["rollout_learner_ratio"] > 0


def test_a_plan_that_does_not_fit_exits_1_with_changes_that_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, plan = plan_json(capsys, SHORT)
    assert code == 1 and plan["fits"] is False and plan["verdict"].startswith("does not fit")
    worst = max(d["total_bytes"] for d in plan["devices"])
    changes = [s["change"] for s in plan["suggestions"]]
    assert changes[0].startswith("train.activation_checkpointing = true")
    assert changes[1].startswith("train.micro_batch_size = 4")
    assert all(s["worst_total_bytes"] < worst for s in plan["suggestions"])
    assert plan["suggestions"][-1]["fits"] is True


def test_the_text_plan_shows_the_verdict_and_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", SHORT]) == 1
    out = capsys.readouterr().out
    assert "verdict: does not fit" in out and "what to change" in out
    assert "params x 4 B" in out and "docs/plan_formulas.md" in out


def test_set_plans_the_run_file_with_a_suggestion_applied(capsys: pytest.CaptureFixture[str]) -> None:
    _, before = plan_json(capsys, SHORT)
    _, after = plan_json(capsys, SHORT, "--set", "train.activation_checkpointing=true")
    first = before["suggestions"][0]
    assert first["change"].startswith("train.activation_checkpointing = true")
    assert max(d["total_bytes"] for d in after["devices"]) == first["worst_total_bytes"]
    assert not after["suggestions"][0]["change"].startswith("train.activation_checkpointing")
    assert main(["plan", SHORT, "--set", "train.micro_batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(--set train.micro_batch_size)" in err


def test_devices_override_the_declared_placement(capsys: pytest.CaptureFixture[str]) -> None:
    code, plan = plan_json(capsys, SHORT, "--devices", "learner=8xcuda:80GiB,rollout=2xcuda:80GiB")
    assert plan["placement"] == "disaggregated"
    assert [(d["name"], d["count"]) for d in plan["devices"]] == [("learner 0-7", 8), ("rollout 0-1", 2)]
    assert code == (0 if plan["fits"] else 1)


def test_a_reward_model_shares_the_first_colocated_device_only(tmp_path: Path) -> None:
    params = {"path": "examples/models/qwen2.5-0.5b", "batch_size": 4}
    reward = RewardSpec(scorer="reward_model", params=params)
    spec = load_config(RunSpec, path=FITS).model_copy(update={"reward": reward})
    resources = ResourcesSpec.model_validate(
        {"placement": "colocated", "learner": {"devices": 4, "memory": "80GiB"}}
    )
    plan = make_plan(spec, resources)
    assert [(d.name, d.count) for d in plan.devices] == [("colocated 0", 1), ("colocated 1-3", 3)]
    assert [r.role for r in plan.devices[0].roles][-1] == "reward"
    assert "reward" not in [r.role for r in plan.devices[1].roles]


def test_throughput_uses_measured_costs_for_the_measured_model(tmp_path: Path) -> None:
    model = tmp_path / "bench-model"
    model.mkdir()
    shape = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8}
    (model / "config.json").write_text(json.dumps({**shape, "intermediate_size": 1280, "vocab_size": 300}))
    results = tmp_path / "results"
    results.mkdir()
    learner = {"result": {"tokens_per_s": {"learner": {"median": 123.0}}}}
    (results / "learner_step.json").write_text(json.dumps(learner))
    spec = RunSpec.model_validate({"model": {"path": str(model)}, "dataset": {"path": "d"}})
    resources = ResourcesSpec.model_validate({"learner": {"kind": "cpu", "devices": 2, "memory": "8GiB"}})
    rates, balance = throughput(Inputs(spec, resources, load_models(spec), 256), results)
    assert rates[0].tokens_per_s == 246.0 and rates[0].source.startswith("measured")
    assert rates[1].source.startswith("bandwidth-based")  # no rollout file here
    assert balance is not None and balance > 0


def test_other_models_are_planned_from_flops() -> None:
    plan = make_plan(load_config(RunSpec, path=FITS))
    assert plan.throughput[0].source.startswith("FLOP-based: 40%")


def test_a_72b_plan_takes_well_under_2_s() -> None:
    spec = load_config(RunSpec, path=FITS)
    spec = spec.model_copy(
        update={"model": spec.model.model_copy(update={"path": "examples/models/qwen2.5-72b"})}
    )
    resources = ResourcesSpec.model_validate({"learner": {"devices": 16, "memory": "80GiB"}})
    start = time.perf_counter()
    plan = make_plan(spec, resources)
    assert time.perf_counter() - start < 2.0
    assert 72e9 < plan.params < 73e9


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["examples/gsm8k-math.toml"], "declares no [resources]"),
        ([FITS, "--devices", "learner=2xtpu:1GiB"], "learner.kind"),
        (["missing.toml"], "not found"),
    ],
)
def test_errors_are_one_line_with_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlfabric plan: ") and message in err


def test_a_hub_id_outside_the_local_cache_is_not_downloaded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run.toml"
    text = (REPO / FITS).read_text().replace("examples/models/qwen2.5-7b", "no-such-org/no-such-model-1b")
    run.write_text(text)
    assert main(["plan", str(run)]) == 2
    assert "not in the local Hugging Face cache" in capsys.readouterr().err


def test_planning_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from rlfabric.cli import main\n"
        f"main(['plan', '{FITS}', '--json'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'vllm', 'transformers'})\n"
        "print(','.join(bad), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fits"] is True
    assert out.stderr.strip() == ""


def test_only_changes_relieving_the_short_devices_are_suggested(capsys: pytest.CaptureFixture[str]) -> None:
    code, plan = plan_json(capsys, FITS, "--devices", "learner=4xcuda:80GiB,rollout=4xcuda:24GiB")
    assert code == 1
    assert [d["fits"] for d in plan["devices"]] == [True, False]  # the replicas are short, not the learner
    changes = [s["change"] for s in plan["suggestions"]]
    assert changes and all(c.startswith("resources.rollout.concurrency") for c in changes), changes
    assert plan["suggestions"][0]["fits"] is True


def test_a_replica_whose_weights_exceed_its_device_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    _, plan = plan_json(capsys, FITS, "--devices", "learner=4xcuda:80GiB,rollout=4xcuda:12GiB")
    assert any("weights alone" in note and "tensor parallelism" in note for note in plan["notes"])
