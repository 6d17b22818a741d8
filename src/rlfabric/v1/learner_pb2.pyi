from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LearnerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEARNER_STATE_UNSPECIFIED: _ClassVar[LearnerState]
    LEARNER_STATE_STARTING: _ClassVar[LearnerState]
    LEARNER_STATE_WAITING: _ClassVar[LearnerState]
    LEARNER_STATE_TRAINING: _ClassVar[LearnerState]
    LEARNER_STATE_PUBLISHING: _ClassVar[LearnerState]
    LEARNER_STATE_DONE: _ClassVar[LearnerState]
    LEARNER_STATE_FAILED: _ClassVar[LearnerState]
LEARNER_STATE_UNSPECIFIED: LearnerState
LEARNER_STATE_STARTING: LearnerState
LEARNER_STATE_WAITING: LearnerState
LEARNER_STATE_TRAINING: LearnerState
LEARNER_STATE_PUBLISHING: LearnerState
LEARNER_STATE_DONE: LearnerState
LEARNER_STATE_FAILED: LearnerState

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("run_id", "state", "step", "policy_version", "checkpoint_step", "groups_trained", "groups_dropped_stale", "groups_skipped_duplicate", "groups_dead_lettered", "last_metrics", "world_size")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_SKIPPED_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: LearnerState
    step: int
    policy_version: int
    checkpoint_step: int
    groups_trained: int
    groups_dropped_stale: int
    groups_skipped_duplicate: int
    groups_dead_lettered: int
    last_metrics: _containers.ScalarMap[str, float]
    world_size: int
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[LearnerState, str]] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., groups_trained: _Optional[int] = ..., groups_dropped_stale: _Optional[int] = ..., groups_skipped_duplicate: _Optional[int] = ..., groups_dead_lettered: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., world_size: _Optional[int] = ...) -> None: ...
