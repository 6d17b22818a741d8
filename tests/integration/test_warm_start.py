"""`rlfabric up`'s supervised steps (`rlfabric.local.warm_start`) with real learner processes on the tiny
model: a warm start trains its SFT run into the run's output folder and hands the online run a spec whose
learner and replicas load the SFT model; a committed warm start is reused without a process; one that
died before its final model resumes from its checkpoint and only writes the model; a failing one raises;
an SFT run file runs its learner alone."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfabric.learner.export import final_model_dir, is_committed
from rlfabric.local.replicas import replica_process
from rlfabric.local.services import learner_process
from rlfabric.local.stack import Stack
from rlfabric.local.warm_start import WarmStartFailed, run_sft_file, warm_start_dir, warm_started
from rlfabric.runspec import RunSpec
from rlfabric.weights import versions as store

ARGS = argparse.Namespace(
    learner_ranks=1,
    compile=False,
    engine="transformers",
    replica_cores=None,
    learner_cores=None,
    replica_max_in_flight=None,
    no_progress=True,
)
STEPS = 4


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """The processes of one `up` in tmp_path/run, stopped (by PID) after the test."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stack = Stack(run_dir)
    yield stack
    stack.stop()


@pytest.fixture
def sft_data(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"name a number above {i}", "completion": f"{i + 1}"} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def online_spec(model: Path, stack: Stack, sft_data: Path, **model_fields: Any) -> RunSpec:
    prompts = stack.run_dir.parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    warm_start = {
        "dataset": {"path": str(sft_data)},
        "optim": {"lr": 3e-3},
        "train": {"steps": STEPS, "groups_per_step": 4, "micro_batch_size": 4, "checkpoint_every": 2},
    }
    raw = {
        "name": "ws",
        "output_dir": str(stack.run_dir),
        "model": {"path": str(model), "max_model_len": 128, **model_fields},
        "dataset": {"path": str(prompts)},
        "warm_start": warm_start,
    }
    return RunSpec.model_validate(raw)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_online_run_starts_from_the_warm_start(
    tiny_model_dir: Path, stack: Stack, sft_data: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = online_spec(tiny_model_dir, stack, sft_data)
    online = warm_started(stack, ARGS, spec)
    final = final_model_dir(warm_start_dir(spec))
    assert final == stack.run_dir / "ws" / "warm_start" / "model" and is_committed(final)
    assert online.model.path == str(final) and online.model.reference_path is None  # the reference follows
    assert online.warm_start is None and online.model_dump(
        exclude={"model", "warm_start"}
    ) == spec.model_dump(exclude={"model", "warm_start"})
    rows = metrics(final.parent)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and rows[-1]["loss"] < rows[0]["loss"]

    learner = learner_process(stack, ARGS, online, "redis://127.0.0.1:1/0")
    config = yaml.safe_load((stack.run_dir / "learner.yaml").read_text())
    assert config["run"]["model"]["path"] == str(final) and learner.name == "learner"
    replica = replica_process(stack, ARGS, online, "redis://127.0.0.1:1/0", 0)
    assert replica.argv[replica.argv.index("--model") + 1] == str(final)
    weights = AutoModelForCausalLM.from_pretrained(online.model.path).state_dict()
    last = store.load_version(final.parent / "weights", STEPS)
    assert all(torch.equal(weights[name], tensor) for name, tensor in last.items())


def test_a_committed_warm_start_is_reused_and_an_unfinished_one_resumes(
    tiny_model_dir: Path, stack: Stack, sft_data: Path
) -> None:
    spec = online_spec(tiny_model_dir, stack, sft_data, reference_path=str(tiny_model_dir))
    first = warm_started(stack, ARGS, spec)
    assert first.model.reference_path == str(tiny_model_dir)  # set explicitly: kept
    processes, rows = len(stack.procs), metrics(warm_start_dir(spec))
    assert warm_started(stack, ARGS, spec) == first and len(stack.procs) == processes  # nothing ran

    final = final_model_dir(warm_start_dir(spec))
    (final / "COMMITTED").unlink()  # as if the learner died after its last checkpoint, before the model
    assert warm_started(stack, ARGS, spec) == first and len(stack.procs) == processes + 1
    assert metrics(warm_start_dir(spec)) == rows and is_committed(final)  # nothing trained again


def test_a_failing_warm_start_raises(tiny_model_dir: Path, stack: Stack, tmp_path: Path) -> None:
    data = tmp_path / "no-answers.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(WarmStartFailed, match="learner of warm_start exited with code"):
        warm_started(stack, ARGS, online_spec(tiny_model_dir, stack, data))


def test_an_sft_run_file_runs_its_learner_alone(tiny_model_dir: Path, stack: Stack, sft_data: Path) -> None:
    spec = online_spec(tiny_model_dir, stack, sft_data).warm_start_spec()
    spec = spec.model_copy(update={"name": "plain"})
    assert run_sft_file(stack, ARGS, spec) == 0
    assert is_committed(final_model_dir(stack.run_dir / "plain"))
    assert [p.name for p in stack.procs] == ["learner-plain"]
