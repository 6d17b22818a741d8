"""The in-process check of a run's scorer, for `rlfabric config check` and `rlfabric up`.

The coordinator asks the reward service (CheckScorer) instead, because it must not load scorers; here the
scorer is built from the registry under the policy `rlfabric up` gives the reward service it starts: user
functions from the run file's folder and the modules the run's reward names. This module imports no
scorer until a check runs, so `rlfabric up` can import it without loading them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlfabric.reward.spec import ScorerProblem, spec_from_reward_spec
from rlfabric.runspec import RewardSpec, RunSpec

FUNCTION_REF = re.compile(r"[\w.]+:[\w.]+")
"""A "package.module:attr" reference to a function in an importable module."""


def spec_functions(reward: RewardSpec) -> list[str]:
    """The "package.module:attr" functions the reward (or its composite parts) names; file paths are
    left to the run file's folder."""
    params = [reward.params, *(part.params for part in reward.parts)]
    named = [str(p["function"]) for p in params if isinstance(p.get("function"), str)]
    return [n for n in named if FUNCTION_REF.fullmatch(n) and not n.split(":")[0].endswith(".py")]


def allowed_functions(reward: RewardSpec | Sequence[RewardSpec], run_file: str | None) -> list[str]:
    """The reward service's `allowed_functions` for a run: the run file's folder and the functions its
    rewards (`run_rewards`: the run's, and an evaluation's gold reward) name by module."""
    folder = [str(Path(run_file).resolve().parent)] if run_file else []
    rewards = [reward] if isinstance(reward, RewardSpec) else list(reward)
    named = [name for r in rewards for name in spec_functions(r)]
    return folder + list(dict.fromkeys(named))


def run_rewards(spec: RunSpec) -> list[RewardSpec]:
    """Every reward the run's Score calls use: its `reward`, and `dataset.eval.reward` when set."""
    gold = spec.dataset.eval.reward
    return [spec.reward] if gold is None else [spec.reward, gold]


def check_scorer_locally(reward: RewardSpec, run_file: str | None) -> list[ScorerProblem]:
    """What is wrong with the reward's scorer ([] when it builds) under `allowed_functions`."""
    from rlfabric.reward.scorers import InvalidScorerSpec, build_scorer
    from rlfabric.reward.scorers.policy import ScorerPolicy

    spec = spec_from_reward_spec(reward)
    policy = ScorerPolicy(allowed_functions=tuple(allowed_functions(reward, run_file)))
    try:
        scorer: Any = build_scorer(spec.name, spec.params, policy)
    except InvalidScorerSpec as exc:
        return [ScorerProblem(exc.field, exc.reason)]
    scorer.close()
    return []
