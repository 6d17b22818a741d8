"""Faults inside one component while the loop runs as real processes: a scorer that raises and one that
hangs past its deadline, a learner killed while writing a checkpoint, a corrupted published weight file,
poison entries in the queue, and a replica that joins mid-run. Each run completes and its ledger balances.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
from collections.abc import Callable

import pytest
from fault_stack import CREDENTIALS, HERE, Stack

from rlfabric.contracts import keys, registry, streams
from rlfabric.v1 import common_pb2, queue_pb2
from rlfabric.weights import versions as store

pytestmark = pytest.mark.faults_full


@pytest.mark.parametrize("function", ["raises_sometimes", "hangs_sometimes"])
def test_failing_scorer_drops_its_groups_with_a_reason(
    make_stack: Callable[..., Stack], function: str
) -> None:
    scorer = {"scorer": "python_function", "params": {"function": f"{HERE / 'fault_scorers.py'}:{function}"}}
    stack = make_stack(reward={**scorer, "item_timeout_s": 2.0})
    stack.start(reward_settings=(f"allowed_functions={json.dumps([str(HERE)])}",))
    status = stack.finish(timeout_s=480)  # each hang holds the one scorer worker ~36 s (seen: 316 s in all)
    counters = status["counters"]
    assert counters["dropped_scorer_error"] >= 1, counters
    books = stack.books()
    assert books.count()["dropped:scorer_error"] == counters["dropped_scorer_error"]
    stack.assert_every_step_trained()
    # The scorer's fault came back as item statuses, so no group was generated twice: a Score call that
    # failed as an RPC (a hung batch answered past the caller's deadline) would be retried from generation.
    assert counters["samples_generated"] <= stack.spec.rollout.sampling.n * counters["prompts_dispatched"]
    expected = "failed: RuntimeError" if function == "raises_sometimes" else "did not finish"
    details = [d["detail"] for d in stack.drops() if d["reason"] == "scorer_error"]
    assert any(expected in d for d in details), details  # (others may time out waiting for the worker)


def test_learner_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack()
    stack.start(failpoints="learner.checkpoint_write=2")  # the checkpoint of step 4
    learner = stack.procs["learner"].proc
    assert learner is not None and learner.wait(180) == -9, stack.tails()
    checkpoints = stack.run_dir / "checkpoints"
    assert (checkpoints / "step-000004.tmp").is_dir()  # torn: tensors without meta or marker
    assert not (checkpoints / "step-000004").exists()
    stack.start_learner()
    stack.finish()
    stack.books()
    stack.assert_every_step_trained()


def test_corrupted_published_version_is_refused_and_replicas_keep_serving(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack()
    stack.start()
    stack.wait_for_step(2)
    learner = stack.procs["learner"]
    learner.signal(signal.SIGSTOP)  # hold the learner so the bad version stays the newest
    try:
        assert stack.client is not None
        root = str(stack.run_dir / "weights")
        good = int(stack.client.get(f"rlfabric:{stack.spec.name}:version"))  # what replicas follow
        stack.wait(lambda: serving_versions(stack).get("rollout-0", ("", -1))[1] == good, 60, "replica on it")
        # Above anything the learner may have been stopped in the middle of writing (latest + 1).
        bad = max(v.version for v in store.list_versions(root)) + 2
        published = store.publish_version(root, bad, store.load_version(root, good))
        folder = stack.run_dir / "weights" / f"v{bad:06d}"
        shard = next(p for p in folder.iterdir() if p.suffix == ".safetensors")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        assert published.version == bad
        stack.client.set(f"rlfabric:{stack.spec.name}:version", bad)  # announced: replicas try to load it
        stack.procs["rollout-0"].wait_for(r"could not load announced version", timeout_s=30)
        served = serving_versions(stack)
        assert {r: v for r, (_, v) in served.items()} == {"rollout-0": good}, served
        assert generate_once(served["rollout-0"][0]) == good  # still answers, on the good version
        shutil.rmtree(stack.run_dir / "weights" / f"v{bad:06d}")  # the operator removes the bad version
        stack.client.set(f"rlfabric:{stack.spec.name}:version", good)
    finally:
        learner.signal(signal.SIGCONT)
    stack.finish()
    stack.books()  # no sample claims the refused version: it is not among the published ones


def serving_versions(stack: Stack) -> dict[str, tuple[str, int]]:
    """replica id -> (address, version) of the serving replicas in the registry."""
    import asyncio

    import redis.asyncio as aioredis

    async def read() -> dict[str, tuple[str, int]]:
        client = aioredis.Redis.from_url(stack.redis_url)
        try:
            entries = await registry.discover(client, stack.spec.name)
        finally:
            await client.aclose()
        return {e.replica_id: (e.address, e.version) for e in entries if e.serving}

    return asyncio.run(read())


def generate_once(address: str) -> int:
    """One Generate call straight to a replica (with its clients' token); the policy version its sample
    carries."""
    import grpc

    from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc

    request = rollout_pb2.GenerateRequest(
        request_id="fault-probe",
        prompts=[rollout_pb2.GeneratePrompt(prompt_id="probe", prompt=common_pb2.Prompt(text="say 1 now"))],
        sampling=rollout_pb2.SamplingParams(n=1, max_tokens=4, temperature=1.0, top_p=1.0),
    )
    with grpc.insecure_channel(address) as channel:
        token = CREDENTIALS["RLFABRIC_ROLLOUT__CLIENT_TOKEN"]
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        samples = list(stub.Generate(request, timeout=30, metadata=(("authorization", f"Bearer {token}"),)))
    return samples[0].policy_version


def test_poison_entries_are_dead_lettered_and_training_continues(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack()
    stack.start()
    stack.wait_for_step(1)
    assert stack.client is not None
    key = keys.groups(stack.spec.name)
    stack.client.xadd(key, {b"data": b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff not protobuf"})
    invalid = queue_pb2.ScoredGroup(run_id=stack.spec.name, group_id="poison:nan", policy_version=0)
    for i in range(stack.spec.rollout.sampling.n):
        sample = invalid.samples.add(sample_index=i, token_ids=[3], logprobs=[math.nan], policy_version=0)
        sample.reward.status = common_pb2.REWARD_STATUS_OK
    stack.client.xadd(key, streams.encode_entry(invalid))  # type: ignore[arg-type]
    stack.finish()
    dead = stack.client.xrange(keys.dead_letters(stack.spec.name))
    assert sorted(f[b"reason"] for _, f in dead) == [b"decode", b"invalid"]
    stack.books()  # both entries accounted for as dead letters; every real group trained once


def test_replica_joining_mid_run_gets_work_only_once_it_holds_a_published_version(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(train={"steps": 8})
    stack.start()
    stack.wait_for_step(3)
    learner = stack.procs["learner"]
    learner.signal(signal.SIGSTOP)  # the rest of the run is shorter than a replica's start on two cores
    try:
        assert stack.client is not None
        announced = int(stack.client.get(f"rlfabric:{stack.spec.name}:version"))
        first = int(stack.start_replica("rollout-late"))
    finally:
        learner.signal(signal.SIGCONT)
    assert first == announced >= 3  # it loaded the run's published version, not the base model
    stack.finish()
    books = stack.books()
    assert stack.client is not None
    late = [
        s.policy_version
        for _, f in stack.client.xrange(keys.groups(stack.spec.name))
        if f.get(b"data")
        for s in queue_pb2.ScoredGroup.FromString(f[b"data"]).samples
        if s.replica_id == "rollout-late"
    ]
    assert late and min(late) >= first, (first, late)  # it got work, all of it on a published version
    assert books.violations == []
