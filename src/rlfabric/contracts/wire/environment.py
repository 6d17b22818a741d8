"""The environment contract's conversions: environment statuses, task rows, Reset and Step requests
and replies, tool schemas and tool-call results.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from rlfabric.contracts.wire.common import struct_from_proto
from rlfabric.environment.types import (
    EnvStatus,
    Observation,
    ResetOutcome,
    StepOutcome,
    StepResult,
    ToolCallRecord,
    ToolSchema,
)
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.v1 import common_pb2, environment_pb2

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
