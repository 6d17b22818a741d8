from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoredGroup(_message.Message):
    __slots__ = ("run_id", "prompt_id", "group_id", "epoch", "prompt_token_ids", "samples", "policy_version", "scorer_name", "scorer_version", "trace", "enqueued_at", "held_out")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCORER_NAME_FIELD_NUMBER: _ClassVar[int]
    SCORER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_AT_FIELD_NUMBER: _ClassVar[int]
    HELD_OUT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    prompt_id: str
    group_id: str
    epoch: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[ScoredSample]
    policy_version: int
    scorer_name: str
    scorer_version: str
    trace: _common_pb2.TraceContext
    enqueued_at: float
    held_out: bool
    def __init__(self, run_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., group_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[ScoredSample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., scorer_name: _Optional[str] = ..., scorer_version: _Optional[str] = ..., trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., enqueued_at: _Optional[float] = ..., held_out: _Optional[bool] = ...) -> None: ...

class ScoredSample(_message.Message):
    __slots__ = ("sample_index", "token_ids", "logprobs", "text", "finish_reason", "policy_version", "replica_id", "reward", "loss_mask", "turns", "tool_calls", "tool_errors")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    replica_id: str
    reward: _common_pb2.Reward
    loss_mask: bytes
    turns: _containers.RepeatedCompositeFieldContainer[_common_pb2.Turn]
    tool_calls: int
    tool_errors: int
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., reward: _Optional[_Union[_common_pb2.Reward, _Mapping]] = ..., loss_mask: _Optional[bytes] = ..., turns: _Optional[_Iterable[_Union[_common_pb2.Turn, _Mapping]]] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ...) -> None: ...
