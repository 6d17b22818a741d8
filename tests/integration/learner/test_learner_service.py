"""The learner as users run it: `rlfabric serve learner` (under torchrun for 2 gloo ranks) consuming
scored groups from a real redis-server, checkpointing, acknowledging and publishing weights.

Crash tests SIGKILL the learner at failpoints (after reading, after a step, after the checkpoint but
before the acknowledgement), restart it, and prove from the final checkpoint's ordered log of applied
groups that every group was trained exactly once in the surviving lineage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
import yaml

from rlfabric.contracts import keys, streams
from rlfabric.learner.checkpoint import META, latest_complete
from rlfabric.v1 import common_pb2, queue_pb2
from rlfabric.weights import versions as store

N = 4  # samples per group
GOOD, BAD = "xxxx", "yyyy"
TOKEN_ENV = {"RLFABRIC_LEARNER__TOKEN": "learner-suite-token"}  # its GetStatus token (required to start)


def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def rollout_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def make_groups(model_dir: Path, run_id: str, count: int, version: int = 0) -> list[queue_pb2.ScoredGroup]:
    """Groups whose rewarded completion is GOOD and unrewarded one BAD, half and half."""
    tok = tokenizer(model_dir)
    prompt = tok.encode("say x:", add_special_tokens=False)
    good, bad = (tok.encode(t, add_special_tokens=False) for t in (GOOD, BAD))
    lp = {GOOD: rollout_logprobs(model_dir, prompt, good), BAD: rollout_logprobs(model_dir, prompt, bad)}
    groups = []
    for g in range(count):
        samples = [
            queue_pb2.ScoredSample(
                sample_index=i,
                token_ids=good if i % 2 == 0 else bad,
                logprobs=lp[GOOD] if i % 2 == 0 else lp[BAD],
                finish_reason=common_pb2.FINISH_REASON_STOP,
                policy_version=version,
                reward=common_pb2.Reward(
                    value=1.0 if i % 2 == 0 else 0.0, status=common_pb2.REWARD_STATUS_OK
                ),
            )
            for i in range(N)
        ]
        groups.append(
            queue_pb2.ScoredGroup(
                run_id=run_id,
                prompt_id=f"p{g}",
                group_id=f"p{g}:e0:a0",
                prompt_token_ids=prompt,
                samples=samples,
                policy_version=version,
            )
        )
    return groups


def enqueue(redis_url: str, run_id: str, groups: list[queue_pb2.ScoredGroup]) -> None:
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(keys.groups(run_id), keys.CONSUMER_GROUP, id="0", mkstream=True)
    for group in groups:
        client.xadd(keys.groups(run_id), streams.encode_entry(group))
    client.close()


def write_config(tmp_path: Path, model_dir: Path, redis_url: str, run_id: str, steps: int) -> Path:
    config = {
        "run_id": run_id,
        "redis": {"url": redis_url},
        "server": {"port": 0},
        "log": {"format": "text"},
        "consumer_name": "learner-test",
        "run": {
            "output_dir": str(tmp_path / "runs"),
            "model": {"path": str(model_dir)},
            "dataset": {"path": "unused.jsonl"},
            "rollout": {"sampling": {"n": N, "max_tokens": 8}, "max_staleness": 100},
            "optim": {"lr": 0.005},
            "train": {"steps": steps, "groups_per_step": 2, "micro_batch_size": 4, "checkpoint_every": 1},
        },
    }
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_learner(config: Path, *, ranks: int, failpoints: str = "", timeout: float = 240) -> int:
    env = {**os.environ, **TOKEN_ENV, "RLFABRIC_FAILPOINTS": failpoints, "OMP_NUM_THREADS": "1"}
    if ranks == 1:
        argv = [sys.executable, "-m", "rlfabric.cli", "serve", "learner", "--config", str(config)]
    else:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "-m", "rlfabric.cli",
            "serve", "learner", "--config", str(config),
        ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise


def applied_log(run_dir: Path) -> list[list[object]]:
    latest = latest_complete(run_dir / "checkpoints")
    assert latest is not None
    extra = json.loads((latest / META).read_text())["extra"]
    return json.loads(extra["applied_log"]["str"])


def sequence_logprob(model_dir: Path, state_dict: dict[str, torch.Tensor], text: str) -> float:
    from transformers import AutoModelForCausalLM

    tok = tokenizer(model_dir)
    prompt = tok.encode("say x:", add_special_tokens=False)
    completion = tok.encode(text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state_dict:
        model.load_state_dict(state_dict, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).sum())


def test_two_rank_learner_trains_checkpoints_acks_and_publishes(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    run_id = "learn2"
    enqueue(redis_url, run_id, make_groups(tiny_model_dir, run_id, 6))
    config = write_config(tmp_path, tiny_model_dir, redis_url, run_id, steps=3)
    assert run_learner(config, ranks=2) == 0
    run_dir = tmp_path / "runs" / run_id
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert all(r["groups_trained"] == 2 * r["step"] for r in rows)
    root = str(run_dir / "weights")
    assert store.latest_committed(root) == 3
    store.verify_version(root, 3)
    trained = store.load_version(root, 3)
    before = sequence_logprob(tiny_model_dir, {}, GOOD) - sequence_logprob(tiny_model_dir, {}, BAD)
    after = sequence_logprob(tiny_model_dir, trained, GOOD) - sequence_logprob(tiny_model_dir, trained, BAD)
    assert after > before + 1.0, (before, after)
    assert sorted(g for _, g in applied_log(run_dir)) == sorted(f"p{i}:e0:a0" for i in range(6))
    client = redis.Redis.from_url(redis_url)
    assert client.xpending(keys.groups(run_id), keys.CONSUMER_GROUP)["pending"] == 0
    assert int(client.get(f"rlfabric:{run_id}:version")) == 3
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).state_dict()
    for name, tensor in trained.items():  # the final model, gathered from both ranks, is version 3
        torch.testing.assert_close(final[name], tensor.float(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "failpoint", ["learner.after_read=2", "learner.after_step=2", "learner.before_ack=2"]
)
def test_killed_learner_resumes_and_trains_every_group_exactly_once(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str, failpoint: str
) -> None:
    run_id = "crash-" + failpoint.split(".")[1].split("=")[0]
    enqueue(redis_url, run_id, make_groups(tiny_model_dir, run_id, 8))
    config = write_config(tmp_path, tiny_model_dir, redis_url, run_id, steps=4)
    assert run_learner(config, ranks=1, failpoints=failpoint) == -9  # SIGKILLed at the failpoint
    assert run_learner(config, ranks=1) == 0
    run_dir = tmp_path / "runs" / run_id
    log = applied_log(run_dir)
    group_ids = [g for _, g in log]
    assert sorted(group_ids) == sorted(f"p{i}:e0:a0" for i in range(8)), log  # each exactly once
    assert [s for s, _ in log] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert store.latest_committed(str(run_dir / "weights")) >= 4
    client = redis.Redis.from_url(redis_url)
    assert client.xpending(keys.groups(run_id), keys.CONSUMER_GROUP)["pending"] == 0


@pytest.mark.parametrize(("reason", "final_checkpoint"), [("health", 2), ("stopped", 3)])
def test_a_health_stop_halts_without_checkpointing_the_suspect_policy(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str, reason: str, final_checkpoint: int
) -> None:
    """After 3 steps (checkpoints every 2) the run is stopped: a health stop leaves step 2 as the newest
    checkpoint and step 3's groups unacknowledged (a resume retrains them once); a plain stop
    checkpoints step 3 and acknowledges everything."""
    run_id = f"halt-{reason}"
    enqueue(redis_url, run_id, make_groups(tiny_model_dir, run_id, 6))
    config = write_config(tmp_path, tiny_model_dir, redis_url, run_id, steps=10)
    settings = yaml.safe_load(config.read_text())
    settings["run"]["train"]["checkpoint_every"] = 2
    config.write_text(yaml.safe_dump(settings))
    client = redis.Redis.from_url(redis_url)
    env = {**os.environ, **TOKEN_ENV, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "learner", "--config", str(config)]
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while int(client.get(f"rlfabric:{run_id}:step") or 0) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the learner did not reach step 3"
            time.sleep(0.2)
        client.set(f"rlfabric:{run_id}:stop_requested", reason)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    latest = latest_complete(tmp_path / "runs" / run_id / "checkpoints")
    assert latest is not None and latest.name == f"step-{final_checkpoint:06d}"
    assert (tmp_path / "runs" / run_id / "model" / "COMMITTED").exists() == (reason == "stopped")
    pending = client.xpending(keys.groups(run_id), keys.CONSUMER_GROUP)["pending"]
    assert pending == (2 if reason == "health" else 0)
