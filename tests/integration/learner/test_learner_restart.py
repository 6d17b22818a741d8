"""A learner restart wastes nothing it need not (`rlfabric.contracts.lineage`): `rlfabric serve learner`
SIGKILLed after publishing versions past its last checkpoint resumes from that checkpoint, publishes its
weights at once as a new version (the same bytes as the checkpoint's own version), trains the groups of
the restored lineage (none dropped as stale for the crash's sake), hands the groups of the rolled-back
version back for re-dispatch, trains their regenerated groups once, and marks the restart in the metrics.

The test plays the coordinator's part: it enqueues hand-made groups and regenerates the handed-back ones
(with the whole loop, tests/faults/test_kills.py does the same with real services and checks the ledger).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import yaml
from test_learner_service import applied_log, enqueue, make_groups

from rlfabric.contracts import keys, lineage, streams
from rlfabric.weights import versions as store

RUN = "restart"


def write_config(tmp_path: Path, model_dir: Path, redis_url: str) -> Path:
    """5 steps of 2 groups, a checkpoint every 2 steps, max_staleness 1, every version kept."""
    config = {
        "run_id": RUN,
        "redis": {"url": redis_url},
        "server": {"port": 0},
        "log": {"format": "text"},
        "consumer_name": "learner-test",
        "token": "restart-suite-token",
        "run": {
            "output_dir": str(tmp_path / "runs"),
            "model": {"path": str(model_dir)},
            "dataset": {"path": "unused.jsonl"},
            "rollout": {"sampling": {"n": 4, "max_tokens": 8}, "max_staleness": 1},
            "optim": {"lr": 0.005},
            "weights": {"keep_versions": 20},
            "train": {"steps": 5, "groups_per_step": 2, "micro_batch_size": 4, "checkpoint_every": 2},
        },
    }
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_learner(config: Path, ranks: int, failpoints: str = "") -> subprocess.Popen[bytes]:
    """One rank, or `ranks` gloo ranks under torchrun (the restore publish is a collective gather)."""
    env = {**os.environ, "RLFABRIC_FAILPOINTS": failpoints, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "learner", "--config", str(config)]
    if ranks > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                *argv[1:]]  # fmt: skip
    return subprocess.Popen(argv, env=env, start_new_session=True)


def wait(proc: subprocess.Popen[bytes], timeout_s: float = 240) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise


def regenerate_handed_back(
    client: redis.Redis, model_dir: Path, count: int, timeout_s: float = 180
) -> list[str]:
    """The coordinator's part: takes `count` handed-back groups and enqueues them generated again by the
    announced (restored) version, under their new ids."""
    taken: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(taken) < count and time.monotonic() < deadline:
        record = asyncio.run(take_one(client))
        if record is None:
            time.sleep(0.2)
            continue
        version = int(client.get(f"rlfabric:{RUN}:version") or 0)
        [group] = make_groups(model_dir, RUN, 1, version=version)
        group.group_id, group.prompt_id = record["group_id"], record["prompt_id"]
        client.xadd(keys.groups(RUN), streams.encode_entry(group))
        taken.append(record["group_id"])
    assert len(taken) == count, taken
    return taken


async def take_one(client: redis.Redis) -> dict[str, object] | None:
    url = "redis://{host}:{port}/{db}".format(**client.connection_pool.connection_kwargs)
    async_client = aioredis.Redis.from_url(url)
    try:
        return await lineage.take_handed_back(async_client, RUN)
    finally:
        await async_client.aclose()


def file_hashes(root: str, version: int) -> list[str]:
    return [f.sha256 for f in store.read_manifest(root, version).files]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_restarted_learner_publishes_the_checkpoint_and_re_dispatches_rolled_back_groups(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str, ranks: int
) -> None:
    # steps 1-4 train groups of versions 0, 0, 1, 2 (each within max_staleness 1); p8, p9 come from version 3
    groups = [g for v, n in [(0, 4), (1, 2), (2, 2), (3, 2)] for g in make_groups(tiny_model_dir, RUN, n, v)]
    for index, group in enumerate(groups):
        group.group_id, group.prompt_id = f"p{index}:e0", f"p{index}"
    enqueue(redis_url, RUN, groups)
    config = write_config(tmp_path, tiny_model_dir, redis_url)
    # life 1: steps 1-3 published versions 1-3; the checkpoint of step 2 is the last; killed after step 4
    killed = wait(start_learner(config, ranks, "learner.after_step=4"))  # every rank kills itself there
    assert killed == -9 if ranks == 1 else killed != 0
    root = str(tmp_path / "runs" / RUN / "weights")
    assert store.latest_committed(root) == 3
    checkpoint_hashes = file_hashes(root, 2)

    # life 2: resumes from step 2, publishes its weights as version 4, rolls version 3 back
    learner = start_learner(config, ranks)
    client = redis.Redis.from_url(redis_url)
    handed_back = regenerate_handed_back(client, tiny_model_dir, 2)
    assert wait(learner) == 0

    assert sorted(handed_back) == ["p8:e0:r1", "p9:e0:r1"]
    assert file_hashes(root, 4) == checkpoint_hashes  # the checkpoint's weights, byte for byte
    assert store.read_manifest(root, 4).metadata == {"step": 2, "restored_step": 2, "weights_of": 2}
    record = lineage.RestoreRecord.from_json(client.hget(keys.lineage(RUN), "4"))
    assert (record.version, record.restored_step, record.weights_of, record.rolled_back) == (4, 2, 2, [3])

    run_dir = tmp_path / "runs" / RUN
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    marker = {"step": 2, "event": "learner_restart", "restored_step": 2, "policy_version": 4}
    assert [{k: r[k] for k in marker} if "event" in r else r["step"] for r in rows] == [
        1,
        2,
        3,
        marker,
        3,
        4,
        5,
    ]
    assert [r["policy_version"] for r in rows if "event" not in r] == [1, 2, 3, 5, 6, 7]
    stream_rows = [json.loads(f[b"row"]) for _, f in client.xrange(f"rlfabric:{RUN}:metrics")]
    assert [r for r in stream_rows if "event" in r] == [r for r in rows if "event" in r]

    trained = [g for _, g in applied_log(run_dir)]
    expected = [f"p{i}:e0" for i in range(8)] + handed_back
    assert sorted(trained) == sorted(expected)  # each once; p8 and p9 only as regenerated
    counters = {k.decode(): int(v) for k, v in client.hgetall(f"rlfabric:{RUN}:counters").items()}
    assert counters.get("dropped_stale", 0) == 0  # p4-p7 (versions 1, 2) are within 1 step of version 4
    assert counters[keys.Counter.ROLLED_BACK] == 2
    records = [
        {k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.rolled_back(RUN))
    ]
    assert sorted((r["group_id"], r["redispatched_as"], r["version"]) for r in records) == [
        ("p8:e0", "p8:e0:r1", "3"),
        ("p9:e0", "p9:e0:r1", "3"),
    ]
    assert client.xpending(keys.groups(RUN), keys.CONSUMER_GROUP)["pending"] == 0


def test_handing_back_is_one_script_that_a_retry_cannot_repeat(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(keys.groups(RUN), keys.CONSUMER_GROUP, id="0", mkstream=True)
    client.xadd(keys.groups(RUN), {"data": b"x"})
    [[_, [(entry_id, _)]]] = client.xreadgroup(keys.CONSUMER_GROUP, "c", {keys.groups(RUN): ">"})
    group = lineage.HandBack(entry_id.decode(), "p1:e2", "p1", 2, 7)

    async def twice() -> list[str | None]:
        async_client = aioredis.Redis.from_url(redis_url)
        try:
            return [await lineage.hand_back(async_client, RUN, group) for _ in range(2)]
        finally:
            await async_client.aclose()

    assert asyncio.run(twice()) == ["p1:e2:r1", None]
    assert client.xpending(keys.groups(RUN), keys.CONSUMER_GROUP)["pending"] == 0
    assert client.xlen(keys.rolled_back(RUN)) == 1
    assert client.hget(f"rlfabric:{RUN}:counters", keys.Counter.ROLLED_BACK) == b"1"
    record = json.loads(client.hget(keys.inflight(RUN), "p1:e2:r1"))
    assert record == {"group_id": "p1:e2:r1", "prompt_id": "p1", "epoch": 2, "position": -1, "attempts": 0}
    assert client.lrange(keys.redispatch(RUN), 0, -1) == [b"p1:e2:r1"]
