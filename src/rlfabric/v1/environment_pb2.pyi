from google.protobuf import struct_pb2 as _struct_pb2
from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENV_STATUS_UNSPECIFIED: _ClassVar[EnvStatus]
    ENV_STATUS_OK: _ClassVar[EnvStatus]
    ENV_STATUS_ENV_ERROR: _ClassVar[EnvStatus]
    ENV_STATUS_TIMEOUT: _ClassVar[EnvStatus]
    ENV_STATUS_TRUNCATED: _ClassVar[EnvStatus]
ENV_STATUS_UNSPECIFIED: EnvStatus
ENV_STATUS_OK: EnvStatus
ENV_STATUS_ENV_ERROR: EnvStatus
ENV_STATUS_TIMEOUT: EnvStatus
ENV_STATUS_TRUNCATED: EnvStatus

class ToolSchema(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("task_struct", "task_json", "seed", "session_ttl_seconds")
    TASK_STRUCT_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    task_struct: _struct_pb2.Struct
    task_json: str
    seed: int
    session_ttl_seconds: float
    def __init__(self, task_struct: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., task_json: _Optional[str] = ..., seed: _Optional[int] = ..., session_ttl_seconds: _Optional[float] = ...) -> None: ...

class ResetReply(_message.Message):
    __slots__ = ("session_id", "status", "message", "observation", "tools")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: EnvStatus
    message: str
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[ToolSchema]
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[EnvStatus, str]] = ..., message: _Optional[str] = ..., observation: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[ToolSchema, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: str
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class ToolCallResult(_message.Message):
    __slots__ = ("name", "arguments_json", "ok", "output")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    ok: bool
    output: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., ok: _Optional[bool] = ..., output: _Optional[str] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("status", "message", "observation", "reward", "done", "info", "tool_calls")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    status: EnvStatus
    message: str
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    reward: float
    done: bool
    info: _containers.ScalarMap[str, str]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallResult]
    def __init__(self, status: _Optional[_Union[EnvStatus, str]] = ..., message: _Optional[str] = ..., observation: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., info: _Optional[_Mapping[str, str]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallResult, _Mapping]]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
