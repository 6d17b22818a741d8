from google.protobuf import struct_pb2 as _struct_pb2
from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("id", "prompt", "completion", "reference", "metadata", "completion_ids", "policy_version", "epoch")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: _common_pb2.Prompt
    completion: str
    reference: str
    metadata: _struct_pb2.Struct
    completion_ids: _common_pb2.TokenIds
    policy_version: int
    epoch: int
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., completion: _Optional[str] = ..., reference: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., completion_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., policy_version: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ScorerSpec(_message.Message):
    __slots__ = ("named", "composite")
    NAMED_FIELD_NUMBER: _ClassVar[int]
    COMPOSITE_FIELD_NUMBER: _ClassVar[int]
    named: NamedScorer
    composite: CompositeScorer
    def __init__(self, named: _Optional[_Union[NamedScorer, _Mapping]] = ..., composite: _Optional[_Union[CompositeScorer, _Mapping]] = ...) -> None: ...

class NamedScorer(_message.Message):
    __slots__ = ("name", "params")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CompositeScorer(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[WeightedScorer]
    def __init__(self, parts: _Optional[_Iterable[_Union[WeightedScorer, _Mapping]]] = ...) -> None: ...

class WeightedScorer(_message.Message):
    __slots__ = ("scorer", "weight", "alias")
    SCORER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    scorer: NamedScorer
    weight: float
    alias: str
    def __init__(self, scorer: _Optional[_Union[NamedScorer, _Mapping]] = ..., weight: _Optional[float] = ..., alias: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "scorer", "item_timeout_seconds")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    ITEM_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    scorer: ScorerSpec
    item_timeout_seconds: float
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., scorer: _Optional[_Union[ScorerSpec, _Mapping]] = ..., item_timeout_seconds: _Optional[float] = ...) -> None: ...

class ItemScore(_message.Message):
    __slots__ = ("id", "reward", "scorer_name", "scorer_version", "latency_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SCORER_NAME_FIELD_NUMBER: _ClassVar[int]
    SCORER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    reward: _common_pb2.Reward
    scorer_name: str
    scorer_version: str
    latency_seconds: float
    def __init__(self, id: _Optional[str] = ..., reward: _Optional[_Union[_common_pb2.Reward, _Mapping]] = ..., scorer_name: _Optional[str] = ..., scorer_version: _Optional[str] = ..., latency_seconds: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ItemScore]
    def __init__(self, results: _Optional[_Iterable[_Union[ItemScore, _Mapping]]] = ...) -> None: ...

class ListScorersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScorerParam(_message.Message):
    __slots__ = ("name", "type", "default_json", "description", "required")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_JSON_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    default_json: str
    description: str
    required: bool
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., default_json: _Optional[str] = ..., description: _Optional[str] = ..., required: _Optional[bool] = ...) -> None: ...

class ScorerDescription(_message.Message):
    __slots__ = ("name", "version", "description", "params")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    params: _containers.RepeatedCompositeFieldContainer[ScorerParam]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., params: _Optional[_Iterable[_Union[ScorerParam, _Mapping]]] = ...) -> None: ...

class ListScorersResponse(_message.Message):
    __slots__ = ("scorers",)
    SCORERS_FIELD_NUMBER: _ClassVar[int]
    scorers: _containers.RepeatedCompositeFieldContainer[ScorerDescription]
    def __init__(self, scorers: _Optional[_Iterable[_Union[ScorerDescription, _Mapping]]] = ...) -> None: ...

class CheckScorerRequest(_message.Message):
    __slots__ = ("scorer",)
    SCORER_FIELD_NUMBER: _ClassVar[int]
    scorer: ScorerSpec
    def __init__(self, scorer: _Optional[_Union[ScorerSpec, _Mapping]] = ...) -> None: ...

class ScorerProblem(_message.Message):
    __slots__ = ("field", "reason")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    field: str
    reason: str
    def __init__(self, field: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckScorerResponse(_message.Message):
    __slots__ = ("problems",)
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    problems: _containers.RepeatedCompositeFieldContainer[ScorerProblem]
    def __init__(self, problems: _Optional[_Iterable[_Union[ScorerProblem, _Mapping]]] = ...) -> None: ...
