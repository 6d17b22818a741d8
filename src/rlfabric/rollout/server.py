"""The RolloutService gRPC adapter: proto -> `Replica` / `Engine` calls -> proto.

Authentication of weight updates and the conversion of wire types live here; the rules about versions,
admission and draining live in `replica.py`, and where weights come from in `weights_source.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from rlfabric.rollout.engine import EngineSample, SamplingSettings
from rlfabric.rollout.replica import Replica
from rlfabric.rollout.weights_source import WeightsSource
from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlfabric.runtime.grpc_server import check_bearer
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        replica: Replica,
        weights: WeightsSource,
        *,
        replica_id: str,
        address: str,
        model: str,
        learner_token: str | None,
        update_timeout_s: float,
        on_serving_change: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.replica = replica
        self.weights = weights
        self.replica_id = replica_id
        self.address = address
        self.model = model
        self.learner_token = learner_token
        self.update_timeout_s = update_timeout_s
        self.on_serving_change = on_serving_change

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GeneratedSample]:
        if not request.request_id:
            raise InvalidArgument("request_id: required")
        if not self.replica.serving:
            raise Unavailable("this replica holds no published weights yet")
        prompts = [self.tokenize(i, p.prompt) for i, p in enumerate(request.prompts)]
        sampling = sampling_from_proto(request.sampling)
        stream = self.replica.generate(request.request_id, prompts, sampling, request.min_policy_version)
        try:
            async for sample, version in stream:
                yield self.sample_to_proto(request, sample, version)
        finally:
            await stream.aclose()  # a cancelled RPC lands here: closing the stream aborts the engine work

    async def UpdateWeights(
        self, request: rollout_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        check_bearer(context, self.learner_token)
        return await self.apply(request)

    async def apply(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        """An update already authorised (by the RPC's token, or because the replica itself decided to
        follow the run's announced version)."""
        current = self.replica.version
        if current is not None and request.version <= current:
            if request.version < current:
                raise FailedPrecondition(
                    f"version: {request.version} is older than the serving version {current}"
                )
            return rollout_pb2.UpdateWeightsResponse(version=current)  # already serving it: a no-op
        was_serving = self.replica.serving
        load, transfer_s = await self.weights.prepare(request)
        timings = await self.replica.update(
            request.version,
            load,
            restore=self.weights.restore_loader(),
            abort_in_flight=request.abort_in_flight,
            timeout_s=request.timeout_seconds or self.update_timeout_s,
        )
        if timings is not None:
            self.weights.commit(request)
        if self.replica.serving != was_serving:
            await self.on_serving_change(self.replica.serving)
        return rollout_pb2.UpdateWeightsResponse(
            version=self.replica.version or 0,
            drain_seconds=timings.drain_s if timings else 0.0,
            transfer_seconds=transfer_s,
            load_seconds=timings.load_s if timings else 0.0,
        )

    async def GetInfo(
        self, request: rollout_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ReplicaInfo:
        return rollout_pb2.ReplicaInfo(
            replica_id=self.replica_id,
            address=self.address,
            model=self.model,
            engine=self.replica.engine.kind,
            policy_version=self.replica.version or 0,
            serving=self.replica.serving,
            in_flight=self.replica.in_flight,
            max_in_flight=self.replica.limits.max_in_flight,
            tokens_generated=self.replica.tokens_generated,
        )

    def tokenize(self, index: int, prompt: common_pb2.Prompt) -> list[int]:
        kind = prompt.WhichOneof("kind")
        if kind == "text":
            return self.replica.engine.tokenize_text(prompt.text)
        if kind == "messages":
            messages = [{"role": m.role, "content": m.content} for m in prompt.messages.messages]
            if not messages:
                raise InvalidArgument(f"prompts[{index}].prompt.messages: empty conversation")
            return self.replica.engine.tokenize_chat(messages)
        if kind == "token_ids":
            return self.check_ids(index, list(prompt.token_ids.ids))
        raise InvalidArgument(f"prompts[{index}].prompt: set text, messages or token_ids")

    def check_ids(self, index: int, ids: list[int]) -> list[int]:
        vocab = self.replica.engine.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidArgument(
                f"prompts[{index}].prompt.token_ids: id {bad[0]} outside the vocabulary of {vocab}"
            )
        return ids

    def sample_to_proto(
        self, request: rollout_pb2.GenerateRequest, sample: EngineSample, version: int
    ) -> rollout_pb2.GeneratedSample:
        return rollout_pb2.GeneratedSample(
            request_id=request.request_id,
            prompt_id=request.prompts[sample.prompt_index].prompt_id,
            prompt_index=sample.prompt_index,
            sample_index=sample.sample_index,
            prompt_token_ids=sample.prompt_token_ids,
            token_ids=sample.token_ids,
            logprobs=sample.logprobs,
            text=sample.text,
            finish_reason=FINISH[sample.finish_reason],
            policy_version=version,
            replica_id=self.replica_id,
            timings=rollout_pb2.SampleTimings(
                first_token_seconds=sample.first_token_s, total_seconds=sample.total_s
            ),
        )


def sampling_from_proto(s: rollout_pb2.SamplingParams) -> SamplingSettings:
    """Wire defaults: n 0 -> 1, top_p 0 -> 1, top_k 0 -> -1 (off); max_tokens must be set."""
    if s.max_tokens == 0:
        raise InvalidArgument("sampling.max_tokens: required (>= 1)")
    if not s.temperature >= 0:
        raise InvalidArgument(f"sampling.temperature: must be >= 0, got {s.temperature}")
    if s.top_k < -1:
        raise InvalidArgument(f"sampling.top_k: must be -1 or 0 (off) or positive, got {s.top_k}")
    if not 0 <= s.top_p <= 1:
        raise InvalidArgument(f"sampling.top_p: must be in (0, 1], got {s.top_p}")
    return SamplingSettings(
        n=s.n or 1,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k if s.top_k > 0 else -1,
        max_tokens=s.max_tokens,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
        ignore_eos=s.ignore_eos,
    )
