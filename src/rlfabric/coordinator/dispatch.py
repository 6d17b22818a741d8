"""Where a run's prompts are generated: one Generate call per group on the least-loaded replica of the
run's pool (or of its lane on a shared fleet), with the prompt as the replica receives it (the dataset's
system prompt and chat-template variables applied; a multi-turn run's task for the environment) and the
adapter its policy version is served under. Used by the run's pipeline (`pipeline.RunPipeline`) and its
held-out evaluation (`evaluation.Evaluator`) alike.

A failure is classified for the caller: `ReplicaFailed` when the replica failed (it is excluded for a
while and the group re-dispatched), `InvalidPrompt` when it refused the prompt itself (INVALID_ARGUMENT
naming `prompts[i]`: longer than the context, empty), which is never the replica's fault.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from rlfabric.contracts import keys, wire
from rlfabric.coordinator.dataset import PromptRow, chat_prompt
from rlfabric.coordinator.fleet import FleetLane
from rlfabric.coordinator.inflight import InFlight, InvalidPrompt, ReplicaFailed
from rlfabric.coordinator.replicas import ReplicaPool
from rlfabric.runspec import RunSpec, SamplingSpec
from rlfabric.v1 import common_pb2, rollout_pb2
from rlfabric.weights.adapters import run_adapter_name

GENERATE_TIMEOUT_S = 600.0
INVALID_PROMPT_FIELD = "prompts["
"""How a replica's INVALID_ARGUMENT names a prompt it refuses (`prompts[0]: ... exceed the context`)."""


def is_invalid_prompt(error: grpc.aio.AioRpcError) -> bool:
    """INVALID_ARGUMENT naming a prompt (`prompts[i]...`, the replica's field-naming convention); other
    INVALID_ARGUMENTs (a duplicate request id, sampling beyond a replica's limits) are replica failures."""
    details = error.details() or ""
    return error.code() == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(INVALID_PROMPT_FIELD)


class Dispatcher:
    """One run's Generate calls (see the module docstring)."""

    def __init__(self, run_id: str, spec: RunSpec, redis: Any, replicas: ReplicaPool | FleetLane) -> None:
        self.run_id, self.spec, self.redis, self.replicas = run_id, spec, redis, replicas

    def prompt_proto(self, row: PromptRow) -> common_pb2.Prompt:
        """The row's prompt as the replica receives it: the system prompt and the chat template's extra
        variables of the dataset spec applied."""
        data = self.spec.dataset
        return wire.prompt_to_proto(
            chat_prompt(row, data),
            chat_template=data.chat_template,
            template_kwargs=data.chat_template_kwargs,
        )

    def task_json(self, row: PromptRow) -> str:
        """A multi-turn run's task for the environment's Reset: the row's columns, its reference (also
        under its own column name) and `prompt` as generation sees it (the system prompt applied); "" for
        a single-turn run."""
        if self.spec.environment is None:
            return ""
        data = self.spec.dataset
        named = {data.reference_field: row.reference} if data.reference_field else {}
        task = {**row.metadata, "reference": row.reference, **named, "prompt": chat_prompt(row, data)}
        return json.dumps(task, default=str)

    def adapter_for(self, version: int) -> str:
        """The replicas' adapter a request at policy `version` names: the run's own (named after the run)
        once the learner has published one, when the run publishes LoRA adapters; "" (the base) otherwise.
        Version 0 of an adapter is the base itself (LoRA starts with B = 0), so it is served by the base."""
        adapter = self.spec.model.published_adapter is not None and version > 0
        return run_adapter_name(self.run_id) if adapter else ""

    async def generate(
        self, item: InFlight, row: PromptRow, sampling: SamplingSpec | None = None
    ) -> list[rollout_pb2.GeneratedSample]:
        """One Generate call on the least-loaded replica (`sampling`: the run's unless given; on a shared
        fleet, a replica that serves the request's adapter, when the run's fair share allows). ReplicaFailed
        when the replica failed (it is excluded for a while), InvalidPrompt when it refused the prompt itself
        (not the replica's fault)."""
        latest = int(await self.redis.get(keys.version(self.run_id)) or 0)  # the learner's announced version
        adapter = self.adapter_for(latest)
        address = await self.replicas.acquire(adapter, latest if adapter else 0)
        request = rollout_pb2.GenerateRequest(
            request_id=f"{self.run_id}:{item.group_id}:a{item.attempts}",
            min_policy_version=latest,
            prompts=[
                rollout_pb2.GeneratePrompt(
                    prompt_id=row.prompt_id,
                    prompt=self.prompt_proto(row),
                    task_json=self.task_json(row),
                )
            ],
            sampling=wire.sampling_to_proto(sampling or self.spec.rollout.sampling),
            adapter=adapter,
        )
        if self.spec.environment is not None:
            env = self.spec.environment
            request.multi_turn.CopyFrom(wire.multi_turn_to_proto(env.max_turns, env.max_total_tokens))
        failed = True
        try:
            samples = [
                s async for s in self.replicas.stub(address).Generate(request, timeout=GENERATE_TIMEOUT_S)
            ]
            failed = not samples
        except grpc.aio.AioRpcError as exc:
            if is_invalid_prompt(exc):
                failed = False
                too_long = wire.is_prompt_too_long(exc.details() or "")
                raise InvalidPrompt(f"{address}: {exc.details()}", too_long=too_long) from exc
            raise ReplicaFailed(f"{address}: {exc.code().name}: {exc.details()}") from exc
        finally:
            await self.replicas.release(address, failed=failed)
        if failed:
            raise ReplicaFailed(f"{address}: the stream ended without samples")
        return sorted(samples, key=lambda s: s.sample_index)
