"""A reward model trained by the learner and served by the reward service, on the tiny model.

The data has a learnable signal: the chosen completion is mostly the letter x, the rejected one random
letters, after varied prompts; a fifth of the pairs are held out. The run (`run_reward_model` in this
process, a world of one) must raise held-out pairwise accuracy far above chance (0.5), and the same run
under torchrun with 2 gloo ranks (`serve_offline`, FSDP2) must train like it; then a real reward
service (`rlfabric serve reward`, called over gRPC) with the `reward_model` scorer pointed at the final
model must score the held-out chosen completions above the rejected ones, and give each completion the
reward the learner's own forward pass gives its token ids (the service tokenizes as the learner did).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.export import final_model_dir, is_committed
from rlfabric.learner.reward_model_data import load_reward_data
from rlfabric.learner.reward_model_run import run_reward_model
from rlfabric.local.procs import ServiceProcess
from rlfabric.reward.client import RewardClient

TORCHRUN = Path(sys.executable).with_name("torchrun")
SERVE = """\
import sys
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.offline import serve_offline
sys.exit(serve_offline(LearnerServiceConfig.model_validate_json(open(sys.argv[1]).read())))
"""
"""What `rlfabric serve learner` runs in the offline modes, given a config file."""
TOKEN = "reward-model-suite-token"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PAIRS = 250
MIN_HELD_OUT_ACCURACY = 0.85
"""Chance is 0.5; runs measured 0.94-1.0 on this data with seeds 0-2 (the untrained model ranked 6-19 % of
the pairs of its first step right)."""


def pair_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Explicit-prompt rows: chosen ~60 % x, rejected uniform letters; both 3-10 letters."""
    rng = random.Random(seed)

    def letters(n: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(n))

    rows = []
    for _ in range(count):
        n = rng.randint(3, 10)
        chosen = "".join("x" if rng.random() < 0.6 else rng.choice(LETTERS) for _ in range(n))
        rows.append({"prompt": f"{letters(rng.randint(2, 8))}?", "chosen": chosen, "rejected": letters(n)})
    return rows


def run_spec(model: Path, data: Path, out: Path) -> dict[str, Any]:
    return {
        "name": "rm",
        "mode": "reward_model",
        "output_dir": str(out),
        "model": {"path": str(model), "max_model_len": 64},
        "dataset": {"path": str(data), "held_out_fraction": 0.2, "eval_every_steps": 4, "epochs": 2},
        "optim": {"lr": 3e-3},
        "train": {"steps": 24, "groups_per_step": 16, "micro_batch_size": 16, "checkpoint_every": 12},
    }


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
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert rc == 0, (out / "serve.log").read_text()[-4000:]


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The finished run: its spec, metrics rows and final model."""
    root = tmp_path_factory.mktemp("rm")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(PAIRS)))
    config = LearnerServiceConfig.model_validate(
        {"run_id": "rm", "run": run_spec(tiny_model_dir, data, root / "out")}
    )
    two = LearnerServiceConfig.model_validate(
        {"run_id": "rm", "run": run_spec(tiny_model_dir, data, root / "out2")}
    )
    ranks = start_two_ranks(two, root / "out2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = run_reward_model(config, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
        finish(ranks, root / "out2")
    run_dir = root / "out" / "rm"
    return {
        "config": config,
        "steps": steps,
        "rows": metrics_rows(run_dir),
        "rows2": metrics_rows(root / "out2" / "rm"),
        "model": final_model_dir(run_dir),
        "model2": final_model_dir(root / "out2" / "rm"),
    }


def test_held_out_accuracy_rises_far_above_chance(trained: dict[str, Any]) -> None:
    rows = trained["rows"]
    assert trained["steps"] == 24 and [r["step"] for r in rows] == list(range(1, 25))
    evaluated = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evaluated] == [4, 8, 12, 16, 20, 24]
    assert evaluated[-1]["eval_accuracy"] >= MIN_HELD_OUT_ACCURACY, [r["eval_accuracy"] for r in evaluated]
    assert evaluated[-1]["eval_pairs"] == PAIRS - len({i for r in rows for i in r["pair_ids"]})
    assert rows[0]["accuracy"] < evaluated[-1]["eval_accuracy"] - 0.3  # the first step scores untrained
    assert sum(r["loss"] for r in rows[-4:]) < sum(r["loss"] for r in rows[:4])
    assert evaluated[-1]["eval_reward_margin"] > 0 and rows[-1]["rm_dropped"] == 0
    assert is_committed(trained["model"])


def test_two_ranks_train_like_one(trained: dict[str, Any]) -> None:
    one, two = trained["rows"], trained["rows2"]
    assert [r["pair_ids"] for r in two] == [r["pair_ids"] for r in one]
    for name in ("loss", "accuracy", "reward_margin", "grad_norm"):  # before float drift compounds
        assert [r[name] for r in two[:8]] == pytest.approx([r[name] for r in one[:8]], rel=1e-3, abs=1e-4)
    assert [r.get("eval_accuracy", -1.0) for r in two] == pytest.approx(
        [r.get("eval_accuracy", -1.0) for r in one], abs=0.05
    )
    assert is_committed(trained["model2"])


@pytest.fixture(scope="module")
def reward_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`rlfabric serve reward` as a process (one worker); yields its address."""
    logs = tmp_path_factory.mktemp("reward")
    proc = ServiceProcess(
        "reward",
        [sys.executable, "-m", "rlfabric.cli", "serve", "reward", "--port", "0", "--set", "workers=1",
         "--set", "log.format=text"],
        log_path=logs / "reward.log",
        env={**os.environ, "RLFABRIC_REWARD__TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    yield proc.start(r"listening on (\S+)", timeout_s=60).group(1)
    assert proc.stop() == 0


def learner_rewards(model_dir: Path, ids: list[list[int]]) -> list[float]:
    """The saved model's reward of each token sequence, scored alone (as the learner scores it)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([seq])).logits[0, 0]) for seq in ids]


def test_the_reward_service_serves_the_model_as_trained(trained: dict[str, Any], reward_service: str) -> None:
    spec = trained["config"].run
    held_out = load_reward_data(spec).evaluation
    rows = pair_rows(PAIRS)
    by_id = [rows[int(p.pair_id)] for p in held_out]
    items = [{"prompt": r["prompt"], "completion": r[side]} for r in by_id for side in ("chosen", "rejected")]
    params = {"path": str(trained["model"]), "batch_size": 16}
    with RewardClient(reward_service, timeout_s=120, token=TOKEN) as client:
        results = client.score(items, "reward_model", params)
    assert all(r.status == "ok" for r in results)
    served = [r.reward for r in results]
    wins = sum(c > r for c, r in zip(served[0::2], served[1::2], strict=True))
    assert wins / len(held_out) >= MIN_HELD_OUT_ACCURACY, (wins, len(held_out))
    ids = [seq for p in held_out for seq in (p.chosen_ids, p.rejected_ids)]
    assert served == pytest.approx(learner_rewards(trained["model"], ids), abs=1e-4)


def test_a_submitted_run_reports_to_its_coordinator(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    """Submitted to a coordinator (`report_to_redis`, as `POST /v1/runs` runs it), the learner reports
    each step through Redis and the coordinator's watch of an offline run sees it complete."""
    import asyncio

    import redis.asyncio as aioredis

    from rlfabric.contracts import keys
    from rlfabric.coordinator.offline import watch_offline
    from rlfabric.coordinator.runs import RunState

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(12)))
    run = {**run_spec(tiny_model_dir, data, tmp_path / "out"), "train": {"steps": 2, "groups_per_step": 4}}
    config = LearnerServiceConfig.model_validate(
        {"run_id": "rm-submitted", "run": run, "redis": {"url": redis_url}, "report_to_redis": True}
    )
    assert run_reward_model(config, torch.device("cpu")) == 2

    async def watch() -> tuple[RunState, int]:
        client = aioredis.Redis.from_url(redis_url)
        try:

            async def never() -> bool:
                return False

            state = await watch_offline(client, "rm-submitted", config.run, never)
            return state, int(await client.get(keys.step("rm-submitted")))
        finally:
            await client.aclose()

    assert asyncio.run(watch()) == (RunState.COMPLETED, 2)
