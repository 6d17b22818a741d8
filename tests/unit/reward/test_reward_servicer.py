"""The Score adapter's conversions, without a server: proto -> ScoreInput, results -> proto, spec cache."""

import math

import pytest
from google.protobuf import struct_pb2

from rlfabric.contracts.wire import item_from_proto, score_response
from rlfabric.reward.scorers import ScoreInput, ScoreResult
from rlfabric.reward.server import RewardServicer, SpecCache
from rlfabric.reward.service import item_to_json
from rlfabric.reward.spec import ScoredBatch
from rlfabric.runtime.errors import InvalidArgument, ResourceExhausted
from rlfabric.v1 import common_pb2, reward_pb2


def named(name: str, **params: object) -> reward_pb2.ScorerSpec:
    struct = struct_pb2.Struct()
    struct.update(params)
    return reward_pb2.ScorerSpec(named=reward_pb2.NamedScorer(name=name, params=struct))


def test_item_conversion_reads_every_field_and_empty_metadata_is_empty():
    metadata = struct_pb2.Struct()
    metadata.update({"tests": [1, 2], "tag": "x"})
    full = reward_pb2.ScoreItem(
        id="a", prompt=common_pb2.Prompt(text="Q"), completion="c", reference="r", metadata=metadata
    )
    assert item_from_proto(0, full) == ScoreInput("a", "Q", "c", "r", {"tests": [1, 2], "tag": "x"})
    set_but_empty = reward_pb2.ScoreItem(completion="", metadata=struct_pb2.Struct())
    assert item_from_proto(3, set_but_empty) == ScoreInput("3", "", "", "", {})
    with pytest.raises(InvalidArgument, match=r"items\[2\]\.completion"):
        item_from_proto(2, reward_pb2.ScoreItem(id="x"))


def test_item_to_json_is_the_worker_protocol_form():
    item = ScoreInput("a", [{"role": "user", "content": "Q"}], "c", "r", {"k": 1})
    assert ScoreInput(**item_to_json(item)) == item


def test_response_keeps_order_provenance_and_nan_for_failures():
    items = [ScoreInput(str(i), "", "c") for i in range(3)]
    results = [
        ScoreResult.ok(1.0, {"extracted": 1.0}),
        ScoreResult.error("bad reference"),
        ScoreResult.timed_out("slow"),
    ]
    response = score_response(items, ScoredBatch(results, "exact_match", "exact_match@1", 0.25))
    assert [r.id for r in response.results] == ["0", "1", "2"]
    ok, failed, slow = (r.reward for r in response.results)
    assert (ok.value, ok.status) == (1.0, common_pb2.REWARD_STATUS_OK)
    assert dict(ok.components) == {"extracted": 1.0}
    assert math.isnan(failed.value) and failed.status == common_pb2.REWARD_STATUS_SCORER_ERROR
    assert failed.message == "bad reference"
    assert math.isnan(slow.value) and slow.status == common_pb2.REWARD_STATUS_TIMEOUT
    assert {(r.scorer_name, r.scorer_version, r.latency_seconds) for r in response.results} == {
        ("exact_match", "exact_match@1", 0.25)
    }


def test_spec_cache_returns_one_spec_object_per_distinct_spec_and_never_caches_errors():
    cache = SpecCache(size=2)
    first = cache.get(named("exact_match", case_sensitive=True))
    assert cache.get(named("exact_match", case_sensitive=True)) is first
    assert first.params == {"case_sensitive": True}
    assert cache.get(named("exact_match")) is not first
    cache.get(named("regex", pattern="x"))  # evicts the least recently used (case_sensitive)
    assert cache.get(named("exact_match", case_sensitive=True)) is not first
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="scorer"):
            cache.get(reward_pb2.ScorerSpec())


def test_size_checks_still_catch_one_oversized_item_in_a_request():
    servicer = RewardServicer(engine=None, max_batch_items=4, max_item_bytes=100)  # type: ignore[arg-type]
    small = reward_pb2.ScoreItem(id="s", completion="x")
    servicer.check_sizes(reward_pb2.ScoreRequest(items=[small, small]))
    big = reward_pb2.ScoreItem(id="b", completion="x" * 200)
    with pytest.raises(ResourceExhausted, match=r"items\[1\]: \d+ bytes"):
        servicer.check_sizes(reward_pb2.ScoreRequest(items=[small, big]))
    with pytest.raises(ResourceExhausted, match="5 items exceed the limit of 4"):
        servicer.check_sizes(reward_pb2.ScoreRequest(items=[small] * 5))
    with pytest.raises(InvalidArgument, match="empty"):
        servicer.check_sizes(reward_pb2.ScoreRequest())
