"""Reward scorers: a registry of small, named scorers and the runner that applies them safely.

Importing this package registers every built-in scorer; none of them imports torch, transformers,
math-verify or grpc until it is used. The service (gRPC), the CLI and the Python client all go through
`build_scorer` + `run_scorer`:

    scorer = build_scorer("math_verify", {})
    results = run_scorer(scorer, items, timeout_s=30)   # one ScoreResult per item, in order
"""

from rlfabric.reward.scorers import (
    code_exec,
    composite,
    exact_match,
    length_penalty,
    llm_judge,
    math_answer,
    overlong_penalty,
    python_function,
    regex_match,
    reward_model,
)
from rlfabric.reward.scorers.base import (
    InvalidScorerSpec,
    ItemError,
    ScoreInput,
    Scorer,
    ScoreResult,
    ScorerParams,
    ScoreStatus,
)
from rlfabric.reward.scorers.registry import (
    SCORERS,
    ParamInfo,
    ScorerInfo,
    build_scorer,
    describe_scorers,
    register,
)
from rlfabric.reward.scorers.runner import arun_scorer, run_scorer, safe_score_batch

__all__ = [
    "SCORERS",
    "InvalidScorerSpec",
    "ItemError",
    "ParamInfo",
    "ScoreInput",
    "ScoreResult",
    "ScoreStatus",
    "Scorer",
    "ScorerInfo",
    "ScorerParams",
    "arun_scorer",
    "build_scorer",
    "code_exec",
    "composite",
    "describe_scorers",
    "exact_match",
    "length_penalty",
    "llm_judge",
    "math_answer",
    "overlong_penalty",
    "python_function",
    "regex_match",
    "register",
    "reward_model",
    "run_scorer",
    "safe_score_batch",
]
