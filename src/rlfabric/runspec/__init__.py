"""The run spec: the user's run file (TOML, YAML or JSON), and the body of `POST /v1/runs`.

This package is the one home of every training-loop default: model, dataset, sampling, reward, algorithm,
optimiser, schedule and weight transport. Services read the sections they need; no service re-declares a
default. A run file holds overrides only, e.g.

    [model]
    path = "Qwen/Qwen2.5-0.5B-Instruct"

    [dataset]
    path = "data/gsm8k.jsonl"

    [reward]
    scorer = "math_verify"

The sections live in one module each, re-exported here (`from rlfabric.runspec import RunSpec`):

    base        SpecModel (strict types) and the upper bounds of every number
    model       [model]: policy, reference, critic, LoRA, a tiny model to build
    generation  [rollout] and [reward]: sampling, the policy-lag bound, scorers
    data        [dataset]: the prompts and the held-out evaluation set
    training    [algorithm], [optim], [train], [weights]
    offline     [preference], [sft], [reward_model], [warm_start]
    health      [health]: run-health thresholds and automatic stops
    tracking    [tracking]: Weights & Biases, MLflow
    run         RunSpec: the whole file and the checks that span sections
"""

from __future__ import annotations

from rlfabric.runspec.base import (
    MAX_BATCH,
    MAX_KEEP,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    RUN_NAME_PATTERN,
    PathKind,
    SpecModel,
)
from rlfabric.runspec.data import DatasetSpec, EvalSpec
from rlfabric.runspec.generation import RewardSpec, RolloutSpec, SamplingSpec, ScorerPart
from rlfabric.runspec.health import HealthCheck, HealthSpec, HealthThresholds
from rlfabric.runspec.model import LoraSpec, ModelSpec, TinyModelRecipe
from rlfabric.runspec.offline import (
    LOSS_ONLY_FIELDS,
    SIMPO_BETA,
    PreferenceLossName,
    PreferenceSpec,
    RewardModelSpec,
    SFTSpec,
    WarmStartSpec,
)
from rlfabric.runspec.run import RunSpec
from rlfabric.runspec.tracking import MlflowSpec, TrackingSpec, WandbSpec
from rlfabric.runspec.training import (
    ADVANTAGE_ALIASES,
    GROUP_ESTIMATORS,
    AlgorithmSpec,
    KLSpec,
    OptimSpec,
    OverlongSpec,
    TrainSpec,
    WeightsSpec,
)

__all__ = [
    "ADVANTAGE_ALIASES",
    "GROUP_ESTIMATORS",
    "LOSS_ONLY_FIELDS",
    "MAX_BATCH",
    "MAX_KEEP",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_TOKENS",
    "RUN_NAME_PATTERN",
    "SIMPO_BETA",
    "AlgorithmSpec",
    "DatasetSpec",
    "EvalSpec",
    "HealthCheck",
    "HealthSpec",
    "HealthThresholds",
    "KLSpec",
    "LoraSpec",
    "MlflowSpec",
    "ModelSpec",
    "OptimSpec",
    "OverlongSpec",
    "PathKind",
    "PreferenceLossName",
    "PreferenceSpec",
    "RewardModelSpec",
    "RewardSpec",
    "RolloutSpec",
    "RunSpec",
    "SFTSpec",
    "SamplingSpec",
    "ScorerPart",
    "SpecModel",
    "TinyModelRecipe",
    "TrackingSpec",
    "TrainSpec",
    "WandbSpec",
    "WarmStartSpec",
    "WeightsSpec",
]
