"""The RolloutService gRPC adapter: proto -> `Replica` / `Engine` calls -> proto (`contracts.wire`).

Authentication and the prompt checks live here: UpdateWeights and UnloadAdapter take the learner's token
only, every other RPC its clients' token (health and reflection are other services and stay open); the
rules about versions, admission, draining and adapter slots live in `replica.py`, and where weights come
from in `weights_source.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from rlfabric.contracts import wire
from rlfabric.rollout.engine import EngineSample
from rlfabric.rollout.replica import PlayTask, Replica
from rlfabric.rollout.trajectory import EnvironmentSessions, TrajectoryDriver, TrajectoryLimits
from rlfabric.rollout.weights_source import WeightsSource
from rlfabric.runtime import failpoints
from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlfabric.runtime.grpc_server import check_bearer
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Generate, UpdateWeights, UnloadAdapter and GetInfo. Each checks its bearer token before reading the
    request: `learner_token` on UpdateWeights and UnloadAdapter, `client_token` on the others (a client's
    token does not authorise an update, nor the learner's a generation); a token of None accepts every
    call."""

    def __init__(
        self,
        replica: Replica,
        weights: WeightsSource,
        *,
        replica_id: str,
        address: str,
        model: str,
        learner_token: str | None,
        client_token: str | None = None,
        update_timeout_s: float,
        on_serving_change: Callable[[bool], Awaitable[None]],
        environment: EnvironmentSessions | None = None,
    ) -> None:
        self.replica = replica
        self.weights = weights
        self.replica_id = replica_id
        self.address = address
        self.model = model
        self.learner_token = learner_token
        self.client_token = client_token
        self.update_timeout_s = update_timeout_s
        self.on_serving_change = on_serving_change
        self.environment = environment
        """The environment service's client for multi-turn requests; None refuses them."""

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GeneratedSample]:
        check_bearer(context, self.client_token)
        if not request.request_id:
            raise InvalidArgument("request_id: required")
        if not self.replica.serving:
            raise Unavailable("this replica holds no published weights yet")
        if request.HasField("multi_turn"):
            async for trajectory in self.play(request):
                yield trajectory
            return
        prompts = [self.tokenize(i, p.prompt) for i, p in enumerate(request.prompts)]
        sampling = wire.sampling_from_proto(request.sampling)
        stream = self.replica.generate(
            request.request_id, prompts, sampling, request.min_policy_version, request.adapter
        )
        try:
            async for sample, version in stream:
                yield self.sample_to_proto(request, sample, version)
        finally:
            await stream.aclose()  # a cancelled RPC lands here: closing the stream aborts the engine work

    async def play(self, request: rollout_pb2.GenerateRequest) -> AsyncIterator[rollout_pb2.GeneratedSample]:
        """A multi-turn request: one trajectory per task and sample (`rollout.trajectory`)."""
        driver = self.trajectory_driver(request.multi_turn)
        tasks = [self.play_task(i, p) for i, p in enumerate(request.prompts)]
        sampling = wire.sampling_from_proto(request.sampling)
        started = time.perf_counter()
        stream = self.replica.play(
            request.request_id, tasks, sampling, driver, request.min_policy_version, request.adapter
        )
        try:
            async for p, s, trajectory, version in stream:
                yield wire.trajectory_to_proto(
                    trajectory,
                    index=(p, s),
                    request_id=request.request_id,
                    prompt_id=request.prompts[p].prompt_id,
                    version=version,
                    replica_id=self.replica_id,
                    total_s=time.perf_counter() - started,
                )
        finally:
            await stream.aclose()

    def trajectory_driver(self, multi_turn: rollout_pb2.MultiTurn) -> TrajectoryDriver:
        if self.environment is None:
            raise FailedPrecondition("multi_turn: this replica has no environment service configured")
        if multi_turn.max_turns < 1:
            raise InvalidArgument("multi_turn.max_turns: must be >= 1")
        context = self.replica.engine.max_model_len
        limits = TrajectoryLimits(
            max_turns=multi_turn.max_turns,
            max_total_tokens=multi_turn.max_total_tokens or context,
            max_model_len=context,
        )
        engine = self.replica.engine
        return TrajectoryDriver(self.replica.engine_turn, self.environment, engine.hf_tokenizer(), limits)

    def play_task(self, index: int, prompt: rollout_pb2.GeneratePrompt) -> PlayTask:
        """The task of `prompts[index]` (its `task_json`) and its chat template variables."""
        try:
            task = json.loads(prompt.task_json or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"prompts[{index}].task_json: not JSON ({exc.msg})") from None
        if not isinstance(task, dict):
            raise InvalidArgument(f"prompts[{index}].task_json: must be a JSON object")
        kwargs = None
        if prompt.prompt.WhichOneof("kind") == "messages":
            kwargs = wire.template_kwargs_from_proto(prompt.prompt.messages)
        return PlayTask(task, kwargs)

    async def UpdateWeights(
        self, request: rollout_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        check_bearer(context, self.learner_token)
        return await self.update(request)

    async def update(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        """An authorised update: of an adapter when `request.adapter` is set, else of the full weights."""
        if request.adapter:
            return await self.apply_adapter(request)
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

    async def apply_adapter(
        self, request: rollout_pb2.UpdateWeightsRequest
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Loads version `request.version` of adapter `request.adapter` from its source (object store or
        broadcast), staged into a folder before the replica drains anything."""
        name, adapters = request.adapter, self.replica.adapters
        adapters.check_room(name)
        held = adapters.get(name)
        if held is not None and held.version is not None and request.version <= held.version:
            self.replica.check_not_older(request.version, held.version, f"adapter {name!r}")
            return rollout_pb2.UpdateWeightsResponse(version=held.version)  # already serving it: a no-op
        start, timeout_s = time.monotonic(), request.timeout_seconds or self.update_timeout_s
        path = await self.weights.prepare_adapter(request, timeout_s)
        transfer_s, old_path = time.monotonic() - start, held.path if held else None
        try:
            timings = await self.replica.update_adapter(
                name,
                request.version,
                path,
                abort_in_flight=request.abort_in_flight,
                timeout_s=timeout_s,
            )
        finally:
            self.discard_unused(name, path, old_path)
        return rollout_pb2.UpdateWeightsResponse(
            version=request.version,
            drain_seconds=timings.drain_s if timings else 0.0,
            transfer_seconds=transfer_s,
            load_seconds=timings.load_s if timings else 0.0,
        )

    def discard_unused(self, name: str, *paths: str | None) -> None:
        """Deletes those of `paths` that adapter `name` does not serve from (replaced, refused, or staged
        by an update that found its version already serving)."""
        serving = self.replica.adapters.get(name)
        for path in set(paths) - {serving.path if serving else None}:
            self.weights.discard_adapter(path)

    async def UnloadAdapter(
        self, request: rollout_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UnloadAdapterResponse:
        check_bearer(context, self.learner_token)
        return await self.unload(request.adapter)

    async def unload(self, name: str) -> rollout_pb2.UnloadAdapterResponse:
        """An authorised unload of adapter `name` (by the RPC's token, or because the replica's fleet no
        longer has the adapter's run): its requests are aborted, its slot and folder freed."""
        held = self.replica.adapters.serving(name)
        version, aborted = await self.replica.unload_adapter(name, self.update_timeout_s)
        self.weights.discard_adapter(held.path)
        return rollout_pb2.UnloadAdapterResponse(version=version, aborted=aborted)

    async def GetInfo(
        self, request: rollout_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ReplicaInfo:
        check_bearer(context, self.client_token)
        failpoints.hit("rollout.get_info")  # the fault tests' hang of an idle replica's event loop
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
            adapters=[
                rollout_pb2.AdapterInfo(name=s.name, version=s.version or 0, in_flight=s.in_flight)
                for s in self.replica.adapters.all()
            ],
            max_adapters=self.replica.adapters.capacity,
        )

    def tokenize(self, index: int, prompt: common_pb2.Prompt) -> list[int]:
        kind = prompt.WhichOneof("kind")
        if kind == "text":
            return self.replica.engine.tokenize_text(prompt.text)
        if kind == "messages":
            messages = wire.messages_from_proto(prompt.messages)
            if not messages:
                raise InvalidArgument(f"prompts[{index}].prompt.messages: empty conversation")
            return self.replica.engine.tokenize_chat(
                messages, wire.template_kwargs_from_proto(prompt.messages)
            )
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
        return wire.sample_to_proto(
            sample,
            request_id=request.request_id,
            prompt_id=request.prompts[sample.prompt_index].prompt_id,
            version=version,
            replica_id=self.replica_id,
        )
