"""The SFT run end to end on the tiny BPE model (Qwen2.5-style tool template) and a JSONL file of tool-call
conversations: the loss and the held-out loss fall, metrics rows, checkpoints and published versions are
written, 2 gloo ranks train like 1, the final model loads with transformers and holds the last published
weights, and a finished run started again trains nothing.

Runs `serve_offline` under torchrun for 2 ranks and `run_sft` in this process (a world of one), each with
one intra-op thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.export import final_model_dir, is_committed
from rlfabric.learner.sft_run import run_sft
from rlfabric.rollout.engine import checkpoint_shapes
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.weights import versions as store

TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 120
STEPS = 8
SERVE = """\
import sys
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.offline import serve_offline
sys.exit(serve_offline(LearnerServiceConfig.model_validate_json(open(sys.argv[1]).read())))
"""
"""What `rlfabric serve learner` runs in the offline modes, given a config file."""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def tool_conversation(a: int, b: int) -> list[dict[str, Any]]:
    """The format to learn: a calculator call, its result, the answer."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}}
    return [
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": json.dumps({"result": a + b})},
        {"role": "assistant", "content": f"The answer is {a + b}."},
    ]


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bpe"), tokenizer="bpe")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 tool conversations (their tools in a column); about a fifth are held out."""
    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    rows = [{"messages": tool_conversation(i, 2 * i + 1), "tools": TOOLS} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_config(model_dir: Path, data: Path, out: Path) -> LearnerServiceConfig:
    run = {
        "mode": "sft",
        "output_dir": str(out),
        "model": {"path": str(model_dir), "max_model_len": 512},
        "dataset": {"path": str(data), "held_out_fraction": 0.2, "eval_every_steps": 4, "epochs": 2},
        "optim": {"lr": 3e-3},
        "train": {"steps": STEPS, "groups_per_step": 5, "micro_batch_size": 2, "checkpoint_every": 4},
    }
    return LearnerServiceConfig.model_validate({"run_id": "sft", "run": run})


def start_two_ranks(config: LearnerServiceConfig, out: Path) -> subprocess.Popen[bytes]:
    """`serve_offline` under torchrun with 2 gloo ranks, in its own process group, on the CPU."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.model_dump_json())
    (out / "serve.py").write_text(SERVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc_per_node", "2"]
    cmd += [str(out / "serve.py"), str(out / "config.json")]
    log = (out / "serve.log").open("ab")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen[bytes], out: Path) -> None:
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert rc == 0, (out / "serve.log").read_text()[-4000:]


def run_here(config: LearnerServiceConfig) -> int:
    """`run_sft` in this process (a world of one), with one intra-op thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_sft(config, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(bpe_model: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The same run with 1 rank (here) and 2 ranks (torchrun, concurrently): 5 rows a step, uneven
    shards."""
    root = tmp_path_factory.mktemp("sft")
    outs = {n: root / f"world{n}" for n in (1, 2)}
    two = start_two_ranks(make_config(bpe_model, dataset, outs[2]), outs[2])
    try:
        assert run_here(make_config(bpe_model, dataset, outs[1])) == STEPS
    finally:
        finish(two, outs[2])
    return outs


def test_the_loss_falls_and_each_step_is_reported(runs: dict[int, Path]) -> None:
    metrics = rows(runs[1])
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert [r["policy_version"] for r in metrics] == list(range(1, STEPS + 1))
    first, last = metrics[0], metrics[-1]
    assert last["loss"] < 0.6 * first["loss"], [round(r["loss"], 3) for r in metrics]
    assert last["token_accuracy"] > first["token_accuracy"]
    evaluated = [r for r in metrics if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [4, 8]
    assert evaluated[-1]["eval_loss"] < evaluated[0]["eval_loss"] < first["loss"]
    assert all(r["sequences"] == 5 and r["tokens"] > 0 and r["sft_truncated"] == 0 for r in metrics)
    ids = [i for r in metrics for i in r["example_ids"]]
    assert len(ids) == 40 and metrics[-1]["examples_consumed"] == 40


def test_two_ranks_train_like_one(runs: dict[int, Path]) -> None:
    for a, b in zip(rows(runs[1]), rows(runs[2]), strict=True):
        assert a["example_ids"] == b["example_ids"] and a["tokens"] == b["tokens"]
        assert ("eval_loss" in a) == ("eval_loss" in b)
        for name in ("loss", "token_accuracy", "grad_norm", "eval_loss"):
            if name in a:
                assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-5), (a["step"], name)


def test_the_final_model_loads_and_holds_the_last_version(runs: dict[int, Path], bpe_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = final_model_dir(runs[1] / "sft")
    assert is_committed(final) and is_committed(final_model_dir(runs[2] / "sft"))
    model = AutoModelForCausalLM.from_pretrained(final)
    published = store.load_version(runs[1] / "sft" / "weights", STEPS)
    loaded = model.state_dict()
    for name, tensor in published.items():
        assert torch.equal(loaded[name], tensor), name
    base = AutoModelForCausalLM.from_pretrained(bpe_model).state_dict()
    assert not torch.equal(base["lm_head.weight"], loaded["lm_head.weight"])
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(bpe_model).chat_template
    # named as the base checkpoint (no lm_head of tied embeddings), as published versions are: a replica
    # serving the final model checks each published version's names against it
    assert checkpoint_shapes(final) == checkpoint_shapes(bpe_model) and set(published) == set(
        checkpoint_shapes(final)
    )


def test_a_finished_run_started_again_trains_nothing(
    runs: dict[int, Path], bpe_model: Path, dataset: Path
) -> None:
    before = rows(runs[1])
    marker = (final_model_dir(runs[1] / "sft") / "COMMITTED").stat().st_mtime_ns
    assert run_here(make_config(bpe_model, dataset, runs[1])) == STEPS
    assert rows(runs[1]) == before
    assert (final_model_dir(runs[1] / "sft") / "COMMITTED").stat().st_mtime_ns == marker
