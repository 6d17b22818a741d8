"""The rollout generator against a scripted RolloutService on loopback: prompts in batches, in order, as
the coordinator sends them (chat template), seeds independent of batching, retries, a refused batch
re-asked prompt by prompt, a pinned version, and failures that make it unusable. The real replica (vLLM)
is in tests/integration/prefs."""

from collections.abc import AsyncIterator

import grpc
import pytest

from rlfabric.contracts import wire
from rlfabric.prefs.generation import (
    GenerationError,
    GeneratorUnusable,
    RolloutGenerator,
    RolloutGeneratorSpec,
)
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


def text_of(prompt: common_pb2.Prompt) -> str:
    if prompt.WhichOneof("kind") == "text":
        return prompt.text
    return "|".join(f"{m.role}:{m.content}" for m in prompt.messages.messages)


class FakeReplica(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers sample k of a prompt with "<prompt>#k" (seeded: "<prompt>#k@<seed of the sample>").
    A prompt containing "BAD" makes the whole request INVALID_ARGUMENT; `failures` are status codes to
    answer the next calls with; `abort_next` aborts the next call's samples."""

    def __init__(self) -> None:
        self.requests: list[rollout_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.failures: list[grpc.StatusCode] = []
        self.version = 0
        self.abort_next = False

    async def GetInfo(self, request, context):
        return rollout_pb2.ReplicaInfo(replica_id="r0", model="/models/tiny", engine="fake", serving=True)

    async def Generate(self, request, context) -> AsyncIterator[rollout_pb2.GeneratedSample]:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        if self.failures:
            await context.abort(self.failures.pop(0), "scripted")
        texts = [text_of(p.prompt) for p in request.prompts]
        if request.sampling.max_tokens > 1000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: must be in [1, 1000]")
        if any("BAD" in t for t in texts):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompts[0].prompt: too long")
        aborted, self.abort_next = self.abort_next, False
        s = request.sampling
        for p, text in reversed(list(enumerate(texts))):  # out of order, as a replica streams
            for k in range(s.n):
                seed = f"@{s.seed + p * s.n + k}" if s.HasField("seed") else ""
                yield rollout_pb2.GeneratedSample(
                    request_id=request.request_id,
                    prompt_index=p,
                    sample_index=k,
                    text=f"{text}#{k}{seed}",
                    policy_version=self.version,
                    finish_reason=common_pb2.FINISH_REASON_ABORT
                    if aborted
                    else common_pb2.FINISH_REASON_STOP,
                )


@pytest.fixture
async def replica():
    server = grpc.aio.server()
    fake = FakeReplica()
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake.address = f"127.0.0.1:{port}"
    yield fake
    await server.stop(None)


def generator(replica, **overrides):
    return RolloutGenerator(RolloutGeneratorSpec(address=replica.address, backoff_s=0.0, **overrides))


async def test_batches_in_order_with_seeds_that_do_not_depend_on_batching(replica):
    prompts = [f"p{i}" for i in range(5)]
    async with generator(replica, batch_size=2, chat_template=False) as gen:
        batched = await gen.generate(prompts, n=2, max_tokens=4, temperature=0.5, seed=100)
    async with generator(replica, batch_size=5, chat_template=False) as gen:
        whole = await gen.generate(prompts, n=2, max_tokens=4, temperature=0.5, seed=100)
    assert batched == whole == [[f"p{i}#0@{100 + 2 * i}", f"p{i}#1@{101 + 2 * i}"] for i in range(5)]
    assert [len(r.prompts) for r in replica.requests] == [2, 2, 1, 5]
    sampling = replica.requests[0].sampling
    assert (sampling.n, sampling.max_tokens, sampling.temperature, sampling.top_p) == (2, 4, 0.5, 1.0)


async def test_prompts_go_as_the_coordinator_sends_them(replica):
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    async with generator(replica, chat_template_kwargs={"enable_thinking": False}) as gen:
        await gen.generate(["plain", chat])
    async with generator(replica, chat_template=False) as gen:
        await gen.generate(["raw"])
    templated, raw = replica.requests
    plain_proto, chat_proto = (p.prompt for p in templated.prompts)
    assert [(m.role, m.content) for m in plain_proto.messages.messages] == [("user", "plain")]
    assert [(m.role, m.content) for m in chat_proto.messages.messages] == [("system", "S"), ("user", "hi")]
    assert wire.template_kwargs_from_proto(chat_proto.messages) == {"enable_thinking": False}
    assert raw.prompts[0].prompt.text == "raw"


async def test_a_refused_batch_is_asked_prompt_by_prompt(replica):
    async with generator(replica, batch_size=4, chat_template=False) as gen:
        ok, bad, ok2 = await gen.generate_each(["a", "BAD", "c"])
        assert ok == ["a#0"] and ok2 == ["c#0"]
        assert isinstance(bad, GenerationError) and "INVALID_ARGUMENT" in str(bad)
        with pytest.raises(GenerationError, match=r"prompts\[1\]"):
            await gen.generate(["a", "BAD"])
    assert [len(r.prompts) for r in replica.requests[:4]] == [3, 1, 1, 1]


async def test_sampling_settings_the_replica_refuses_make_the_generator_unusable(replica):
    async with generator(replica) as gen:
        with pytest.raises(GeneratorUnusable, match=r"sampling\.max_tokens"):
            await gen.generate_each(["a", "b"], max_tokens=1001)
    assert len(replica.requests) == 1  # not re-asked prompt by prompt


async def test_unavailable_full_and_aborted_calls_are_retried(replica):
    replica.failures = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED]
    replica.abort_next = True
    async with generator(replica, max_retries=3, chat_template=False) as gen:
        assert await gen.generate(["x"]) == [["x#0"]]
    assert len(replica.requests) == 4
    replica.failures = [grpc.StatusCode.UNAVAILABLE] * 3
    async with generator(replica, max_retries=1, chat_template=False) as gen:
        [outcome] = await gen.generate_each(["x"])
    assert isinstance(outcome, GenerationError) and "after 2 attempt(s)" in str(outcome)


async def test_other_failures_are_per_prompt_without_retry(replica):
    replica.failures = [grpc.StatusCode.INTERNAL]
    async with generator(replica) as gen:
        [outcome] = await gen.generate_each(["x"])
    assert isinstance(outcome, GenerationError) and "INTERNAL" in str(outcome)
    assert len(replica.requests) == 1


async def test_the_token_is_sent_and_a_refused_one_makes_the_generator_unusable(replica, monkeypatch):
    monkeypatch.setenv("RLF_TEST_REPLICA_TOKEN", "t0ken")
    replica.failures = [grpc.StatusCode.UNAUTHENTICATED]
    async with generator(replica, token_env="RLF_TEST_REPLICA_TOKEN") as gen:
        with pytest.raises(GeneratorUnusable, match="UNAUTHENTICATED"):
            await gen.generate(["x"])
        assert "t0ken" not in str(gen.describe())
    assert replica.metadata[0]["authorization"] == "Bearer t0ken"


async def test_a_pinned_version_is_asked_for_and_enforced(replica):
    replica.version = 3
    async with generator(replica, model_version=3) as gen:
        await gen.generate(["x"])
        described = gen.describe()
    assert replica.requests[0].min_policy_version == 3
    assert described["model"] == "/models/tiny" and described["policy_versions"] == [3]
    assert described["model_version"] == 3 and described["replica_id"] == "r0"
    replica.version = 4
    async with generator(replica, model_version=3) as gen:
        with pytest.raises(GeneratorUnusable, match="serves policy version 4"):
            await gen.generate(["x"])


async def test_an_unreachable_replica_is_unusable():
    gen = RolloutGenerator(RolloutGeneratorSpec(address="127.0.0.1:9", max_retries=1, backoff_s=0.0))
    with pytest.raises(GeneratorUnusable, match=r"127\.0\.0\.1:9"):
        await gen.generate(["x"])
    await gen.close()
