from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class RewardStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REWARD_STATUS_UNSPECIFIED: _ClassVar[RewardStatus]
    REWARD_STATUS_OK: _ClassVar[RewardStatus]
    REWARD_STATUS_SCORER_ERROR: _ClassVar[RewardStatus]
    REWARD_STATUS_TIMEOUT: _ClassVar[RewardStatus]
    REWARD_STATUS_NOT_APPLICABLE: _ClassVar[RewardStatus]

class TurnRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_ROLE_UNSPECIFIED: _ClassVar[TurnRole]
    TURN_ROLE_MODEL: _ClassVar[TurnRole]
    TURN_ROLE_ENVIRONMENT: _ClassVar[TurnRole]
    TURN_ROLE_TOOL: _ClassVar[TurnRole]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
REWARD_STATUS_UNSPECIFIED: RewardStatus
REWARD_STATUS_OK: RewardStatus
REWARD_STATUS_SCORER_ERROR: RewardStatus
REWARD_STATUS_TIMEOUT: RewardStatus
REWARD_STATUS_NOT_APPLICABLE: RewardStatus
TURN_ROLE_UNSPECIFIED: TurnRole
TURN_ROLE_MODEL: TurnRole
TURN_ROLE_ENVIRONMENT: TurnRole
TURN_ROLE_TOOL: TurnRole

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "template_kwargs")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    template_kwargs: _struct_pb2.Struct
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "messages", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: ChatMessages
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class Reward(_message.Message):
    __slots__ = ("value", "status", "message", "components")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    value: float
    status: RewardStatus
    message: str
    components: _containers.ScalarMap[str, float]
    def __init__(self, value: _Optional[float] = ..., status: _Optional[_Union[RewardStatus, str]] = ..., message: _Optional[str] = ..., components: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("start", "role", "reward")
    START_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    start: int
    role: TurnRole
    reward: float
    def __init__(self, start: _Optional[int] = ..., role: _Optional[_Union[TurnRole, str]] = ..., reward: _Optional[float] = ...) -> None: ...
