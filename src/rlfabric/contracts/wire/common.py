"""Conversions every contract shares: reward statuses and finish reasons with their inverses, structs,
prompts and chat messages, the prompt-too-long refusal, W3C trace context.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import json_format, struct_pb2

from rlfabric.reward.spec import (
    Message,
    ScoreStatus,
)
from rlfabric.rollout.types import FinishReason
from rlfabric.runtime.errors import InvalidArgument
from rlfabric.v1 import common_pb2

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


def reward_status_from_proto(value: common_pb2.RewardStatus) -> ScoreStatus:
    """A received status; an unknown or unset one is a scorer error (never a reward)."""
    return REWARD_STATUS_NAMES.get(value, "scorer_error")


def finish_reason_from_proto(value: common_pb2.FinishReason) -> FinishReason:
    """A received finish reason; an unset one reads as "stop" (a sample that ended normally)."""
    return FINISH_REASON_NAMES.get(value, "stop")


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
