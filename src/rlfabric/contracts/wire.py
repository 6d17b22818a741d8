"""Every conversion between the protobuf contract (`rlfabric.v1`) and the domain types, in one place.

Servicers and clients convert here and nowhere else, so the two ends of an RPC, and the writer and the
reader of a stored payload, cannot drift apart. Each enum map has its inverse next to it, total over the
enum's values (tests check both). This module imports only the generated stubs and plain domain types
(`reward.spec`, `rollout.types`, `learner.samples`, `weights.broadcast.TensorMeta`, `runspec`): no torch,
no scorer, no server.

    reward     ScorerSpec <-> ScorerSpec, ScoreInput <-> ScoreItem, ScoredBatch -> ScoreResponse,
               ItemScore -> ItemResult, "ok" | "scorer_error" | "timeout" | "not_applicable" <-> RewardStatus
    rollout    SamplingSpec -> SamplingParams -> SamplingSettings, EngineSample -> GeneratedSample,
               "stop" | "length" | "abort" <-> FinishReason, TensorMeta <-> TensorSpec,
               BroadcastSource -> BroadcastPlan
    prompts    text or chat messages <-> Prompt
    queue      (GeneratedSample, ItemResult) pairs -> ScoredGroup -> GroupSamples; bytes -> ScoredGroup;
               multi-turn loss mask <-> bytes, Turn <-> Turn, "model" | "environment" | "tool" <-> TurnRole
    traces     W3C carrier <-> TraceContext
    environment  task row -> ResetRequest -> task row, ResetOutcome <-> ResetReply,
               StepOutcome <-> StepReply, ToolSchema <-> ToolSchema, "ok" | "env_error" | ... <-> EnvStatus
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import json_format, struct_pb2

from rlfabric.environment.types import (
    EnvStatus,
    Observation,
    ResetOutcome,
    StepOutcome,
    StepResult,
    ToolCallRecord,
    ToolSchema,
)
from rlfabric.learner.samples import GroupSamples, Rollout, Turn, TurnRole
from rlfabric.reward.spec import (
    COMPOSITE,
    ItemResult,
    Message,
    ScoredBatch,
    ScoreInput,
    ScorerInfo,
    ScorerProblem,
    ScorerSpec,
    ScoreStatus,
    composite_part,
)
from rlfabric.rollout.types import EngineSample, FinishReason, SamplingSettings
from rlfabric.runspec import SamplingSpec
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.v1 import common_pb2, environment_pb2, queue_pb2, reward_pb2, rollout_pb2
from rlfabric.weights.broadcast import DEFAULT_BUCKET_BYTES, Backend, BroadcastPlan, TensorMeta

# --- enums ------------------------------------------------------------------------------------------

REWARD_STATUS: dict[ScoreStatus, common_pb2.RewardStatus] = {
    "ok": common_pb2.REWARD_STATUS_OK,
    "scorer_error": common_pb2.REWARD_STATUS_SCORER_ERROR,
    "timeout": common_pb2.REWARD_STATUS_TIMEOUT,
    "not_applicable": common_pb2.REWARD_STATUS_NOT_APPLICABLE,
}
"""A score's status on the wire (UNSPECIFIED is never sent)."""
REWARD_STATUS_NAMES: dict[common_pb2.RewardStatus, ScoreStatus] = {v: k for k, v in REWARD_STATUS.items()}
"""The inverse of `REWARD_STATUS`."""

FINISH_REASON: dict[FinishReason, common_pb2.FinishReason] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
"""Why a sample ended, on the wire (UNSPECIFIED is never sent)."""
FINISH_REASON_NAMES: dict[common_pb2.FinishReason, FinishReason] = {v: k for k, v in FINISH_REASON.items()}
"""The inverse of `FINISH_REASON`."""

TURN_ROLE: dict[TurnRole, queue_pb2.TurnRole] = {
    "model": queue_pb2.TURN_ROLE_MODEL,
    "environment": queue_pb2.TURN_ROLE_ENVIRONMENT,
    "tool": queue_pb2.TURN_ROLE_TOOL,
}
"""Who produced a turn, on the wire (UNSPECIFIED is never sent)."""
TURN_ROLE_NAMES: dict[queue_pb2.TurnRole, TurnRole] = {v: k for k, v in TURN_ROLE.items()}
"""The inverse of `TURN_ROLE`."""


def reward_status_from_proto(value: common_pb2.RewardStatus) -> ScoreStatus:
    """A received status; an unknown or unset one is a scorer error (never a reward)."""
    return REWARD_STATUS_NAMES.get(value, "scorer_error")


def finish_reason_from_proto(value: common_pb2.FinishReason) -> FinishReason:
    """A received finish reason; an unset one reads as "stop" (a sample that ended normally)."""
    return FINISH_REASON_NAMES.get(value, "stop")


def turn_role_from_proto(value: queue_pb2.TurnRole) -> TurnRole:
    """A received turn role; an unset one reads as "environment". The role is provenance only: what is
    trained on is decided by the loss mask."""
    return TURN_ROLE_NAMES.get(value, "environment")


# --- shared message parts ---------------------------------------------------------------------------


def struct_to_proto(data: Mapping[str, Any]) -> struct_pb2.Struct:
    """A JSON-like mapping as a `Struct` (numbers become doubles)."""
    message = struct_pb2.Struct()
    message.update(dict(data))
    return message


def struct_from_proto(message: struct_pb2.Struct) -> dict[str, Any]:
    """A `Struct` as a plain dict."""
    return json_format.MessageToDict(message)


def prompt_to_proto(
    prompt: str | Sequence[Mapping[str, str]],
    *,
    chat_template: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> common_pb2.Prompt:
    """Chat messages as `messages`; text as `text`, or, with `chat_template`, as one user message (the
    replica then renders it with the model's chat template, given `template_kwargs`)."""
    if not isinstance(prompt, str):
        return common_pb2.Prompt(messages=messages_to_proto(prompt, template_kwargs))
    if chat_template:
        user = [{"role": "user", "content": prompt}]
        return common_pb2.Prompt(messages=messages_to_proto(user, template_kwargs))
    return common_pb2.Prompt(text=prompt)


def messages_to_proto(
    messages: Iterable[Mapping[str, str]], template_kwargs: Mapping[str, Any] | None = None
) -> common_pb2.ChatMessages:
    """[{"role", "content"}] (and the chat template's extra variables) as `ChatMessages`."""
    return common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        template_kwargs=struct_to_proto(template_kwargs) if template_kwargs else None,
    )


def template_kwargs_from_proto(messages: common_pb2.ChatMessages) -> dict[str, Any]:
    """The chat template's extra variables ({} when none). Integral numbers come back as ints (a
    `Struct` carries every number as a double)."""
    found = struct_from_proto(messages.template_kwargs)
    return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in found.items()}


PROMPT_TOO_LONG = "too long for the context"
"""What a replica's INVALID_ARGUMENT for a prompt that leaves no room for `max_tokens` says (see
`prompt_too_long_details`), so a caller can tell it from the other refusals of a prompt."""


def prompt_too_long_details(index: int, prompt_tokens: int, max_tokens: int, context: int) -> str:
    """The status details of Generate's refusal of `prompts[index]` as too long."""
    return (
        f"prompts[{index}]: {PROMPT_TOO_LONG}: {prompt_tokens} prompt tokens + max_tokens {max_tokens} "
        f"exceed the context of {context}"
    )


def is_prompt_too_long(details: str) -> bool:
    """True for the details of a refusal written by `prompt_too_long_details`."""
    return details.startswith("prompts[") and f": {PROMPT_TOO_LONG}: " in details


def messages_from_proto(messages: common_pb2.ChatMessages) -> list[Message]:
    """The inverse of `messages_to_proto`."""
    return [{"role": m.role, "content": m.content} for m in messages.messages]


def text_prompt_from_proto(prompt: common_pb2.Prompt) -> str | list[Message]:
    """A prompt as text or messages (an unset prompt is ""); token ids are refused: they carry no text."""
    kind = prompt.WhichOneof("kind")
    if kind == "messages":
        return messages_from_proto(prompt.messages)
    if kind == "token_ids":
        raise InvalidArgument("prompt.token_ids: the reward service scores text; send text or messages")
    return prompt.text


def trace_to_proto(carrier: Mapping[str, str]) -> common_pb2.TraceContext:
    """A W3C carrier (`runtime.telemetry.trace_carrier`) as a `TraceContext`; empty fields when empty."""
    return common_pb2.TraceContext(
        traceparent=carrier.get("traceparent", ""), tracestate=carrier.get("tracestate", "")
    )


def trace_from_proto(message: common_pb2.TraceContext) -> dict[str, str]:
    """The inverse of `trace_to_proto`, without the empty fields."""
    carrier = {"traceparent": message.traceparent, "tracestate": message.tracestate}
    return {key: value for key, value in carrier.items() if value}


# --- reward: scorer specs ---------------------------------------------------------------------------


def scorer_spec_to_proto(spec: ScorerSpec) -> reward_pb2.ScorerSpec:
    """A named spec, or a composite of its `parts` (weight 1 and no alias unless given)."""
    if spec.name != COMPOSITE:
        return reward_pb2.ScorerSpec(named=named_to_proto(spec.name, spec.params))
    parts = [part_to_proto(p) for p in spec.params.get("parts", [])]
    return reward_pb2.ScorerSpec(composite=reward_pb2.CompositeScorer(parts=parts))


def named_to_proto(name: str, params: Mapping[str, Any]) -> reward_pb2.NamedScorer:
    """One scorer with its parameters."""
    return reward_pb2.NamedScorer(name=name, params=struct_to_proto(params))


def part_to_proto(part: Mapping[str, Any]) -> reward_pb2.WeightedScorer:
    """One `composite_part` dict (or a run file's part) as a `WeightedScorer`."""
    return reward_pb2.WeightedScorer(
        scorer=named_to_proto(part["scorer"], part.get("params", {})),
        weight=part.get("weight", 1.0),
        alias=part.get("alias") or "",
    )


def scorer_spec_from_proto(spec: reward_pb2.ScorerSpec) -> ScorerSpec:
    """The spec a request names; InvalidArgument naming the field when it names none."""
    kind = spec.WhichOneof("kind")
    if kind == "named":
        if not spec.named.name:
            raise InvalidArgument("scorer.named.name: a scorer name is required")
        return ScorerSpec(spec.named.name, struct_from_proto(spec.named.params))
    if kind == "composite":
        parts = [part_from_proto(i, p) for i, p in enumerate(spec.composite.parts)]
        return ScorerSpec(COMPOSITE, {"parts": parts})
    raise InvalidArgument("scorer: set either `named` or `composite`")


def part_from_proto(index: int, part: reward_pb2.WeightedScorer) -> dict[str, Any]:
    """Part `index` of a composite as a `composite_part` dict."""
    if not part.scorer.name:
        raise InvalidArgument(f"scorer.composite.parts[{index}].scorer.name: a scorer name is required")
    return composite_part(part.scorer.name, struct_from_proto(part.scorer.params), part.weight, part.alias)


def scorer_problems_to_proto(problems: Iterable[ScorerProblem]) -> reward_pb2.CheckScorerResponse:
    """CheckScorer's answer: the spec's problems (none: valid)."""
    return reward_pb2.CheckScorerResponse(
        problems=[reward_pb2.ScorerProblem(field=p.field, reason=p.reason) for p in problems]
    )


def scorer_problems_from_proto(response: reward_pb2.CheckScorerResponse) -> list[ScorerProblem]:
    """The problems of a CheckScorer answer, in its order."""
    return [ScorerProblem(p.field, p.reason) for p in response.problems]


def scorer_description_to_proto(info: ScorerInfo) -> reward_pb2.ScorerDescription:
    """A registered scorer as ListScorers describes it (a required parameter has no default)."""
    return reward_pb2.ScorerDescription(
        name=info.name,
        version=info.version,
        description=info.description,
        params=[
            reward_pb2.ScorerParam(
                name=p.name,
                type=p.type,
                default_json=p.default or "",
                description=p.description,
                required=p.required,
            )
            for p in info.params
        ],
    )


def scorer_descriptions_from_proto(response: reward_pb2.ListScorersResponse) -> list[dict[str, Any]]:
    """ListScorers' answer as JSON-ready dicts, with the proto field names."""
    return [json_format.MessageToDict(s, preserving_proto_field_name=True) for s in response.scorers]


# --- reward: items and results ----------------------------------------------------------------------


def score_request(
    items: Sequence[ScoreInput], spec: ScorerSpec, item_timeout_s: float | None
) -> reward_pb2.ScoreRequest:
    """One Score call; `item_timeout_s` None leaves the server's default."""
    return reward_pb2.ScoreRequest(
        items=[item_to_proto(x) for x in items],
        scorer=scorer_spec_to_proto(spec),
        item_timeout_seconds=item_timeout_s or 0.0,
    )


def item_to_proto(item: ScoreInput) -> reward_pb2.ScoreItem:
    """One item; metadata is left unset when empty."""
    return reward_pb2.ScoreItem(
        id=item.id,
        prompt=prompt_to_proto(item.prompt),
        completion=item.completion,
        reference=item.reference,
        metadata=struct_to_proto(item.metadata) if item.metadata else None,
        completion_ids=None if item.completion_ids is None else common_pb2.TokenIds(ids=item.completion_ids),
        policy_version=item.policy_version,
        epoch=item.epoch,
    )


def item_from_proto(index: int, item: reward_pb2.ScoreItem) -> ScoreInput:
    """Item `index` of a request; its id defaults to the index. InvalidArgument without a completion."""
    if not item.HasField("completion"):
        raise InvalidArgument(f"items[{index}].completion: required (an empty string is allowed)")
    return ScoreInput(
        item.id or str(index),
        text_prompt_from_proto(item.prompt),
        item.completion,
        item.reference,
        metadata_from_proto(item),
        list(item.completion_ids.ids) if item.HasField("completion_ids") else None,
        item.policy_version if item.HasField("policy_version") else None,
        item.epoch if item.HasField("epoch") else None,
    )


def metadata_from_proto(item: reward_pb2.ScoreItem) -> dict[str, Any]:
    """The item's metadata columns; {} when unset or empty (without a conversion)."""
    if not item.HasField("metadata") or not item.metadata.fields:
        return {}
    return struct_from_proto(item.metadata)


def score_response(items: Sequence[ScoreInput], scored: ScoredBatch) -> reward_pb2.ScoreResponse:
    """The response for `items` and their results, written field by field into messages the response
    owns (for cheap scorers this conversion is most of the server's CPU per item)."""
    response = reward_pb2.ScoreResponse()
    add = response.results.add
    name, version, latency = scored.scorer_name, scored.scorer_version, scored.latency_s
    for item, result in zip(items, scored.results, strict=True):
        out = add()
        out.id = item.id
        reward = out.reward
        reward.value = result.reward  # NaN unless OK: a failure must never read as a reward of 0
        reward.status = REWARD_STATUS[result.status]
        if result.message:
            reward.message = result.message
        if result.components:
            components = reward.components
            for key, value in result.components.items():
                components[key] = value
        out.scorer_name = name
        out.scorer_version = version
        out.latency_seconds = latency
    return response


def item_result_from_proto(result: reward_pb2.ItemScore) -> ItemResult:
    """One received score; the reward is NaN unless the status is "ok", whatever the value says."""
    status = reward_status_from_proto(result.reward.status)
    return ItemResult(
        id=result.id,
        reward=result.reward.value if status == "ok" else math.nan,
        status=status,
        message=result.reward.message,
        components=dict(result.reward.components),
        scorer_name=result.scorer_name,
        scorer_version=result.scorer_version,
        latency_s=result.latency_seconds,
    )


# --- rollout ----------------------------------------------------------------------------------------


def sampling_to_proto(sampling: SamplingSpec, n: int | None = None) -> rollout_pb2.SamplingParams:
    """A run's sampling section as request parameters; `n` overrides the group size."""
    return rollout_pb2.SamplingParams(
        n=n or sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        stop=sampling.stop,
    )


def sampling_from_proto(s: rollout_pb2.SamplingParams) -> SamplingSettings:
    """Wire defaults: n 0 -> 1, top_p 0 -> 1, top_k 0 -> -1 (off); max_tokens must be set. The values are
    then checked by `SamplingSettings` (InvalidArgument naming the field)."""
    if s.max_tokens == 0:
        raise InvalidArgument("sampling.max_tokens: required (>= 1)")
    return SamplingSettings(
        n=s.n or 1,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=-1 if s.top_k == 0 else s.top_k,
        max_tokens=s.max_tokens,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
        ignore_eos=s.ignore_eos,
    )


def sample_to_proto(
    sample: EngineSample, *, request_id: str, prompt_id: str, version: int, replica_id: str
) -> rollout_pb2.GeneratedSample:
    """One finished sample of request `request_id`, generated by `version` on `replica_id`."""
    return rollout_pb2.GeneratedSample(
        request_id=request_id,
        prompt_id=prompt_id,
        prompt_index=sample.prompt_index,
        sample_index=sample.sample_index,
        prompt_token_ids=sample.prompt_token_ids,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        text=sample.text,
        finish_reason=FINISH_REASON[sample.finish_reason],
        policy_version=version,
        replica_id=replica_id,
        timings=rollout_pb2.SampleTimings(
            first_token_seconds=sample.first_token_s, total_seconds=sample.total_s
        ),
    )


def metas_to_proto(metas: Iterable[TensorMeta]) -> list[rollout_pb2.TensorSpec]:
    """Metas as `TensorSpec` messages, for `BroadcastSource.tensors`."""
    return [rollout_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape)) for m in metas]


def metas_from_proto(specs: Iterable[rollout_pb2.TensorSpec]) -> list[TensorMeta]:
    """The inverse of `metas_to_proto`."""
    return [TensorMeta(s.name, s.dtype, tuple(int(d) for d in s.shape)) for s in specs]


def broadcast_from_proto(source: rollout_pb2.BroadcastSource) -> BroadcastPlan:
    """A receiver's broadcast plan; an unset backend is gloo, an unset bucket size the default."""
    return BroadcastPlan(
        metas=metas_from_proto(source.tensors),
        host=source.master_address,
        port=source.master_port,
        rank=source.rank,
        world_size=source.world_size,
        backend=backend_from_proto(source.backend),
        bucket_bytes=source.bucket_bytes or DEFAULT_BUCKET_BYTES,
    )


def backend_from_proto(backend: str) -> Backend:
    """The collective backend a `BroadcastSource` names ("" is gloo); InvalidArgument for another."""
    if backend in ("", "gloo"):
        return "gloo"
    if backend == "nccl":
        return "nccl"
    raise InvalidArgument(f"broadcast.backend: must be gloo or nccl, got {backend!r}")


# --- the scored-group queue -------------------------------------------------------------------------


def scored_group(
    *,
    run_id: str,
    prompt_id: str,
    group_id: str,
    epoch: int,
    samples: Sequence[rollout_pb2.GeneratedSample],
    scores: Sequence[ItemResult],
    trace: Mapping[str, str],
    enqueued_at: float,
) -> queue_pb2.ScoredGroup:
    """A group's samples with their scores (`scores[i]` for `samples[i]`), stamped with the first
    sample's policy version and the scorer of the first score."""
    version = samples[0].policy_version
    return queue_pb2.ScoredGroup(
        run_id=run_id,
        prompt_id=prompt_id,
        group_id=group_id,
        epoch=epoch,
        prompt_token_ids=samples[0].prompt_token_ids,
        samples=[scored_sample(s, r, version) for s, r in zip(samples, scores, strict=True)],
        policy_version=version,
        scorer_name=scores[0].scorer_name,
        scorer_version=scores[0].scorer_version,
        trace=trace_to_proto(trace),
        enqueued_at=enqueued_at,
    )


def scored_sample(
    sample: rollout_pb2.GeneratedSample, score: ItemResult, version: int
) -> queue_pb2.ScoredSample:
    """One sample of a group with its reward (value, status and components; the message stays out)."""
    return queue_pb2.ScoredSample(
        sample_index=sample.sample_index,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        text=sample.text,
        finish_reason=sample.finish_reason,
        policy_version=version,
        replica_id=sample.replica_id,
        reward=common_pb2.Reward(
            value=score.reward, status=REWARD_STATUS[score.status], components=score.components
        ),
    )


def decode_group(data: bytes) -> queue_pb2.ScoredGroup:
    """A stream entry's payload; raises `google.protobuf.message.DecodeError` for one that is no group."""
    return queue_pb2.ScoredGroup.FromString(data)


def group_versions(group: queue_pb2.ScoredGroup) -> set[int]:
    """Every policy version a group names: its own and each sample's."""
    return {group.policy_version, *(s.policy_version for s in group.samples)}


def group_samples_from_proto(group: queue_pb2.ScoredGroup) -> GroupSamples:
    """What the learner trains on: the prompt and the samples in sample-index order."""
    rollouts = [rollout_from_proto(s) for s in sorted(group.samples, key=lambda s: s.sample_index)]
    return GroupSamples(list(group.prompt_token_ids), rollouts, group.group_id)


def rollout_from_proto(sample: queue_pb2.ScoredSample) -> Rollout:
    """One scored sample as the learner trains on it, with its multi-turn fields when it has them."""
    return Rollout(
        token_ids=list(sample.token_ids),
        logprobs=list(sample.logprobs),
        reward=sample.reward.value,
        finish_reason=finish_reason_from_proto(sample.finish_reason),
        policy_version=sample.policy_version,
        components=dict(sample.reward.components),
        loss_mask=loss_mask_from_proto(sample.loss_mask),
        turns=[turn_from_proto(t) for t in sample.turns],
    )


def with_turns(
    sample: queue_pb2.ScoredSample, loss_mask: Sequence[int] | None, turns: Iterable[Turn]
) -> queue_pb2.ScoredSample:
    """`sample` with the multi-turn fields of a trajectory set: its loss mask (one 0/1 per completion
    token; None = all the policy's) and its turns. Returns the same message."""
    sample.loss_mask = loss_mask_to_proto(loss_mask)
    sample.turns.extend(turn_to_proto(t) for t in turns)
    return sample


def loss_mask_to_proto(mask: Sequence[int] | None) -> bytes:
    """One byte per completion token (1 = the policy's, 0 = the environment's); None is empty bytes."""
    return b"" if mask is None else bytes(mask)


def loss_mask_from_proto(data: bytes) -> list[int] | None:
    """The loss mask of a received sample; None when it has none (every token the policy's)."""
    return list(data) if data else None


def turn_to_proto(turn: Turn) -> queue_pb2.Turn:
    """A turn on the wire; an unrewarded turn leaves `reward` unset."""
    message = queue_pb2.Turn(start=turn.start, role=TURN_ROLE[turn.role])
    if turn.reward is not None:
        message.reward = turn.reward
    return message


def turn_from_proto(turn: queue_pb2.Turn) -> Turn:
    """A received turn; an unset reward stays None (no reward, not 0)."""
    reward = turn.reward if turn.HasField("reward") else None
    return Turn(start=turn.start, role=turn_role_from_proto(turn.role), reward=reward)


# --- environment ------------------------------------------------------------------------------------

ENV_STATUS: dict[EnvStatus, environment_pb2.EnvStatus] = {
    "ok": environment_pb2.ENV_STATUS_OK,
    "env_error": environment_pb2.ENV_STATUS_ENV_ERROR,
    "timeout": environment_pb2.ENV_STATUS_TIMEOUT,
    "truncated": environment_pb2.ENV_STATUS_TRUNCATED,
}
"""An environment call's status on the wire (UNSPECIFIED is never sent)."""
ENV_STATUS_NAMES: dict[environment_pb2.EnvStatus, EnvStatus] = {v: k for k, v in ENV_STATUS.items()}
"""The inverse of `ENV_STATUS`."""


def env_status_from_proto(value: environment_pb2.EnvStatus) -> EnvStatus:
    """A received status; an unknown or unset one is an environment error (never a success)."""
    return ENV_STATUS_NAMES.get(value, "env_error")


def chat_messages_to_proto(messages: Iterable[Mapping[str, str]]) -> list[common_pb2.ChatMessage]:
    """Chat messages as repeated `ChatMessage` (role and content; other keys are not sent)."""
    return [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def chat_messages_from_proto(messages: Iterable[common_pb2.ChatMessage]) -> list[dict[str, str]]:
    """The inverse of `chat_messages_to_proto`."""
    return [{"role": m.role, "content": m.content} for m in messages]


def reset_request(
    task: Mapping[str, Any], seed: int | None = None, session_ttl_s: float | None = None
) -> environment_pb2.ResetRequest:
    """A Reset for `task` (sent as JSON text, so numbers keep their type)."""
    request = environment_pb2.ResetRequest(task_json=json.dumps(dict(task)))
    if seed is not None:
        request.seed = seed
    if session_ttl_s is not None:
        request.session_ttl_seconds = session_ttl_s
    return request


def task_from_proto(request: environment_pb2.ResetRequest) -> dict[str, Any]:
    """The task row of a Reset ({} when unset); `InvalidArgument` naming the field when it is not an
    object."""
    kind = request.WhichOneof("task")
    if kind == "task_struct":
        return struct_from_proto(request.task_struct)
    if kind != "task_json":
        return {}
    try:
        task = json.loads(request.task_json)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"task_json: not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(task, dict):
        raise InvalidArgument(f"task_json: expected a JSON object, got {type(task).__name__}")
    return task


def tool_schema_to_proto(tool: ToolSchema) -> environment_pb2.ToolSchema:
    """A tool declaration on the wire (its arguments schema as JSON text)."""
    parameters = json.dumps(tool.parameters)
    return environment_pb2.ToolSchema(
        name=tool.name, description=tool.description, parameters_json=parameters
    )


def tool_schema_from_proto(tool: environment_pb2.ToolSchema) -> ToolSchema:
    """The inverse of `tool_schema_to_proto`; an empty schema is an object without properties."""
    parameters = json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object"}
    return ToolSchema(tool.name, tool.description, parameters)


def reset_reply(outcome: ResetOutcome) -> environment_pb2.ResetReply:
    """The answer to a Reset."""
    return environment_pb2.ResetReply(
        session_id=outcome.session_id,
        status=ENV_STATUS[outcome.status],
        message=outcome.message,
        observation=chat_messages_to_proto(outcome.observation.messages),
        tools=[tool_schema_to_proto(t) for t in outcome.observation.tools],
    )


def reset_outcome_from_proto(reply: environment_pb2.ResetReply) -> ResetOutcome:
    """The inverse of `reset_reply`."""
    tools = [tool_schema_from_proto(t) for t in reply.tools]
    observation = Observation(chat_messages_from_proto(reply.observation), tools)
    return ResetOutcome(env_status_from_proto(reply.status), reply.session_id, observation, reply.message)


def step_request(session_id: str, action: str) -> environment_pb2.StepRequest:
    """A Step of `action` in the session."""
    return environment_pb2.StepRequest(session_id=session_id, action=action)


def step_reply(outcome: StepOutcome) -> environment_pb2.StepReply:
    """The answer to a Step; a step without a reward leaves `reward` unset."""
    result = outcome.result
    reply = environment_pb2.StepReply(
        status=ENV_STATUS[outcome.status],
        message=outcome.message,
        observation=chat_messages_to_proto(result.messages),
        done=result.done,
        info=dict(result.info),
        tool_calls=[tool_call_to_proto(r) for r in result.tool_calls],
    )
    if result.reward is not None:
        reply.reward = result.reward
    return reply


def step_outcome_from_proto(reply: environment_pb2.StepReply) -> StepOutcome:
    """The inverse of `step_reply`; an unset reward stays None (no reward, not 0)."""
    status = env_status_from_proto(reply.status)
    result = StepResult(
        messages=chat_messages_from_proto(reply.observation),
        reward=reply.reward if reply.HasField("reward") else None,
        done=reply.done,
        info=dict(reply.info),
        tool_calls=[tool_call_from_proto(c) for c in reply.tool_calls],
        truncated=status == "truncated",
    )
    return StepOutcome(status, result, reply.message)


def tool_call_to_proto(record: ToolCallRecord) -> environment_pb2.ToolCallResult:
    """One tool call's outcome on the wire."""
    return environment_pb2.ToolCallResult(
        name=record.name, arguments_json=record.arguments, ok=record.ok, output=record.output
    )


def tool_call_from_proto(result: environment_pb2.ToolCallResult) -> ToolCallRecord:
    """The inverse of `tool_call_to_proto`."""
    return ToolCallRecord(result.name, result.arguments_json, result.ok, result.output)
