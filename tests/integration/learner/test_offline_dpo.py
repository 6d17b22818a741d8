"""The offline preference run end to end on the tiny model and a JSONL file (a Parquet file and a saved
split load the same pairs): metrics, published versions, 2 gloo ranks training like 1, and a SIGKILLed
run resuming with no pair trained twice.

Runs `serve_offline` in subprocesses (a plain process, or torchrun for 2 ranks) and `run_offline` in this
process (a world of one), each with one intra-op thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlfabric.learner.checkpoint import META, checkpoint_dir, latest_complete
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.offline import load_pairs, run_offline, training_order
from rlfabric.weights import versions as store

TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 90
SERVE = """\
import sys
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.offline import serve_offline
sys.exit(serve_offline(LearnerServiceConfig.model_validate_json(open(sys.argv[1]).read())))
"""
"""The worker script: what `rlfabric serve learner` runs in offline mode, given a config file."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 pairs preferring a "yes" answer over "no"; one prompt is given as chat messages."""
    path = tmp_path_factory.mktemp("data") / "prefs.jsonl"
    rows: list[dict[str, Any]] = [
        {"prompt": f"is {i} a number?", "chosen": "yes", "rejected": "no"} for i in range(23)
    ]
    rows.append({"prompt": [{"role": "user", "content": "ok?"}], "chosen": "yes", "rejected": "no"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_config(model_dir: Path, data: Path, out: Path, **train: int) -> LearnerServiceConfig:
    run = {
        "mode": "offline_preference",
        "output_dir": str(out),
        "model": {"path": str(model_dir), "max_model_len": 64},
        "dataset": {"path": str(data), "shuffle_seed": 3},
        "optim": {"lr": 2e-3},
        "train": {"steps": 4, "groups_per_step": 3, "micro_batch_size": 2, "checkpoint_every": 2, **train},
    }
    return LearnerServiceConfig.model_validate({"run_id": "dpo", "run": run})


def start(config: LearnerServiceConfig, out: Path, nproc: int = 1) -> subprocess.Popen[bytes]:
    """`serve_offline` in its own process group (a plain process, or torchrun with `nproc` gloo ranks),
    on the CPU."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "config.json"
    cfg.write_text(config.model_dump_json())
    script = out / "serve.py"
    script.write_text(SERVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(script), str(cfg)]
    if nproc > 1:
        cmd = [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc), *cmd[1:]]
    log = (out / "serve.log").open("ab")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen[bytes], out: Path) -> None:
    """Wait for `proc`; kill its process group on timeout."""
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert rc == 0, (out / "serve.log").read_text()[-4000:]


def run_here(config: LearnerServiceConfig) -> int:
    """`run_offline` in this process (a world of one), with one intra-op thread like the subprocesses."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_offline(config, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]


def final_rows(out: Path) -> dict[int, dict[str, Any]]:
    """The surviving lineage: the last row written for each step."""
    return {row["step"]: row for row in rows(out)}


def checkpoint_extra(out: Path) -> dict[str, Any]:
    latest = latest_complete(out / "dpo" / "checkpoints")
    assert latest is not None
    extra = json.loads((latest / META).read_text())["extra"]
    return {key: value["str"] for key, value in extra.items()}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The output folders of the same 4-step run with 1 rank (in this process, one thread) and 2 ranks
    (torchrun, concurrently); 3 pairs a step: uneven shards."""
    root = tmp_path_factory.mktemp("offline")
    outs = {n: root / f"world{n}" for n in (1, 2)}
    two = start(make_config(tiny_model_dir, dataset, outs[2]), outs[2], nproc=2)
    try:
        assert run_here(make_config(tiny_model_dir, dataset, outs[1])) == 4
    finally:
        finish(two, outs[2])
    return outs


def test_pairs_are_tokenised_with_the_chat_template(tiny_model_dir: Path, dataset: Path) -> None:
    from transformers import AutoTokenizer

    config = make_config(tiny_model_dir, dataset, dataset.parent)
    pairs = load_pairs(config.run)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (
        tok.decode(pairs[0].prompt_token_ids)
        == "<|im_start|>user\nis 0 a number?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tok.decode(pairs[23].prompt_token_ids) == "<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert pairs[0].chosen_token_ids == [*tok.encode("yes", add_special_tokens=False), tok.eos_token_id]
    order = training_order(pairs, epochs=2, seed=3)
    assert [p.pair_id for p in order[:24]] != [str(i) for i in range(24)]
    assert sorted(p.pair_id for p in order[24:]) == sorted(str(i) for i in range(24))
    assert order[:24] != order[24:]  # each epoch has its own shuffle


def test_pairs_load_from_parquet_and_saved_splits_as_from_jsonl(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    """The pairs read through `rlfabric.data`, as the coordinator reads prompts: a Parquet file and a
    split of a `save_to_disk` DatasetDict give the pairs the JSONL file gives."""
    import datasets

    rows = [json.loads(line) for line in dataset.read_text().splitlines()][:23]  # Arrow: one prompt type
    jsonl = tmp_path / "prefs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = load_pairs(make_config(tiny_model_dir, jsonl, tmp_path).run)
    parquet = tmp_path / "prefs.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert load_pairs(make_config(tiny_model_dir, parquet, tmp_path).run) == expected
    saved = tmp_path / "saved"
    splits = {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows)}
    datasets.DatasetDict(splits).save_to_disk(str(saved))
    run = make_config(tiny_model_dir, saved, tmp_path).run
    run = run.model_copy(update={"dataset": run.dataset.model_copy(update={"split": "test"})})
    assert load_pairs(run) == expected


def test_run_writes_metrics_checkpoints_and_versions(runs: dict[int, Path]) -> None:
    out = runs[1]
    metrics = rows(out)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in metrics] == [1, 2, 3, 4]
    assert metrics[0]["loss"] == pytest.approx(0.6931472, abs=1e-5)  # policy == reference at step 0
    assert metrics[-1]["reward_margin"] > 0 and metrics[-1]["reward_accuracy"] > 0.5
    ids = [i for r in metrics for i in r["pair_ids"]]
    assert len(ids) == len(set(ids)) == 12 and metrics[-1]["pairs_consumed"] == 12
    root = out / "dpo" / "weights"
    assert store.latest_committed(root) == 4
    for info in store.list_versions(root):
        assert store.verify_version(root, info.version).policy_version == info.version
    assert checkpoint_extra(out)["cursor"] == "12"
    assert json.loads(checkpoint_extra(out)["consumed"]) == ids


def test_two_ranks_train_like_one(runs: dict[int, Path]) -> None:
    one, two = rows(runs[1]), rows(runs[2])
    for a, b in zip(one, two, strict=True):
        assert a["pair_ids"] == b["pair_ids"] and a["pairs"] == b["pairs"] == 3
        for name in ("loss", "reward_margin", "reward_accuracy", "logps_chosen", "grad_norm"):
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-5), (a["step"], name)


def test_resume_after_sigkill_trains_each_pair_once(
    tiny_model_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    """Killed once the step-4 checkpoint is complete; the checkpoint's ledger of consumed pairs and the
    metrics rows of the surviving lineage show every step trained once, on the expected pairs."""
    config = make_config(tiny_model_dir, dataset, tmp_path, steps=6, groups_per_step=2)
    second = checkpoint_dir(tmp_path / "dpo" / "checkpoints", 4)
    proc = start(config, tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    while not second.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = rows(tmp_path)
    assert second.is_dir() and killed[-1]["step"] < 6, "the run was not killed mid-way"
    version_before = store.latest_committed(tmp_path / "dpo" / "weights") or 0

    assert run_here(config) == 6  # resumed in this process
    resumed = rows(tmp_path)[len(killed) :]
    assert [r["step"] for r in resumed] == [5, 6]  # from the step-4 checkpoint to the end
    assert resumed[0]["policy_version"] > version_before  # versions never go back
    order = [p.pair_id for p in training_order(load_pairs(config.run), 1, 3)]
    ledger = json.loads(checkpoint_extra(tmp_path)["consumed"])
    assert ledger == order[:12] and len(set(ledger)) == 12
    for step, row in final_rows(tmp_path).items():  # rows agree with the ledger, step by step
        assert row["pair_ids"] == ledger[2 * (step - 1) : 2 * step]
    root = tmp_path / "dpo" / "weights"
    latest = store.latest_committed(root)
    assert latest == resumed[-1]["policy_version"]
    assert store.verify_version(root, latest).policy_version == latest


def test_resume_refuses_a_changed_dataset_order(
    runs: dict[int, Path], tiny_model_dir: Path, dataset: Path
) -> None:
    config = make_config(tiny_model_dir, dataset, runs[1], steps=6)
    config.run.dataset.shuffle_seed = 4
    with pytest.raises(ValueError, match="the dataset or its order changed"):
        run_here(config)
