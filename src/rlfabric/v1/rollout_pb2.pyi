from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrajectoryStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAJECTORY_STATUS_UNSPECIFIED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_DONE: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_TRUNCATED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_ENV_ERROR: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_ENV_TIMEOUT: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_TEMPLATE_MISMATCH: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_ABORTED: _ClassVar[TrajectoryStatus]
TRAJECTORY_STATUS_UNSPECIFIED: TrajectoryStatus
TRAJECTORY_STATUS_DONE: TrajectoryStatus
TRAJECTORY_STATUS_TRUNCATED: TrajectoryStatus
TRAJECTORY_STATUS_ENV_ERROR: TrajectoryStatus
TRAJECTORY_STATUS_ENV_TIMEOUT: TrajectoryStatus
TRAJECTORY_STATUS_TEMPLATE_MISMATCH: TrajectoryStatus
TRAJECTORY_STATUS_ABORTED: TrajectoryStatus

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "ignore_eos")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    ignore_eos: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "sampling", "min_policy_version", "multi_turn", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MULTI_TURN_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[GeneratePrompt]
    sampling: SamplingParams
    min_policy_version: int
    multi_turn: MultiTurn
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[GeneratePrompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., multi_turn: _Optional[_Union[MultiTurn, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class MultiTurn(_message.Message):
    __slots__ = ("max_turns", "max_total_tokens")
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_turns: int
    max_total_tokens: int
    def __init__(self, max_turns: _Optional[int] = ..., max_total_tokens: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("status", "message", "loss_mask", "turns", "messages", "tool_calls", "tool_errors", "prompt_tokens", "cached_prompt_tokens")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    status: TrajectoryStatus
    message: str
    loss_mask: bytes
    turns: _containers.RepeatedCompositeFieldContainer[_common_pb2.Turn]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tool_calls: int
    tool_errors: int
    prompt_tokens: int
    cached_prompt_tokens: int
    def __init__(self, status: _Optional[_Union[TrajectoryStatus, str]] = ..., message: _Optional[str] = ..., loss_mask: _Optional[bytes] = ..., turns: _Optional[_Iterable[_Union[_common_pb2.Turn, _Mapping]]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GeneratePrompt(_message.Message):
    __slots__ = ("prompt_id", "prompt", "task_json")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt: _common_pb2.Prompt
    task_json: str
    def __init__(self, prompt_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., task_json: _Optional[str] = ...) -> None: ...

class GeneratedSample(_message.Message):
    __slots__ = ("request_id", "prompt_id", "prompt_index", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "text", "finish_reason", "policy_version", "replica_id", "timings", "trajectory")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_id: str
    prompt_index: int
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    replica_id: str
    timings: SampleTimings
    trajectory: Trajectory
    def __init__(self, request_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., timings: _Optional[_Union[SampleTimings, _Mapping]] = ..., trajectory: _Optional[_Union[Trajectory, _Mapping]] = ...) -> None: ...

class SampleTimings(_message.Message):
    __slots__ = ("first_token_seconds", "total_seconds")
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token_seconds: float
    total_seconds: float
    def __init__(self, first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "object_store", "broadcast", "abort_in_flight", "timeout_seconds", "adapter")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OBJECT_STORE_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    object_store: ObjectStoreSource
    broadcast: BroadcastSource
    abort_in_flight: bool
    timeout_seconds: float
    adapter: str
    def __init__(self, version: _Optional[int] = ..., object_store: _Optional[_Union[ObjectStoreSource, _Mapping]] = ..., broadcast: _Optional[_Union[BroadcastSource, _Mapping]] = ..., abort_in_flight: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ..., adapter: _Optional[str] = ...) -> None: ...

class ObjectStoreSource(_message.Message):
    __slots__ = ("root_url",)
    ROOT_URL_FIELD_NUMBER: _ClassVar[int]
    root_url: str
    def __init__(self, root_url: _Optional[str] = ...) -> None: ...

class BroadcastSource(_message.Message):
    __slots__ = ("master_address", "master_port", "rank", "world_size", "backend", "tensors", "bucket_bytes", "adapter_config_json")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank: int
    world_size: int
    backend: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    bucket_bytes: int
    adapter_config_json: str
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., bucket_bytes: _Optional[int] = ..., adapter_config_json: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "drain_seconds", "transfer_seconds", "load_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    drain_seconds: float
    transfer_seconds: float
    load_seconds: float
    def __init__(self, version: _Optional[int] = ..., drain_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    def __init__(self, adapter: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("version", "aborted")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    version: int
    aborted: int
    def __init__(self, version: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "version", "in_flight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    in_flight: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "address", "model", "engine", "policy_version", "serving", "in_flight", "max_in_flight", "tokens_generated", "adapters", "max_adapters")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    model: str
    engine: str
    policy_version: int
    serving: bool
    in_flight: int
    max_in_flight: int
    tokens_generated: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_adapters: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., policy_version: _Optional[int] = ..., serving: _Optional[bool] = ..., in_flight: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_adapters: _Optional[int] = ...) -> None: ...
