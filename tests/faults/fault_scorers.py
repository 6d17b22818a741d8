"""Reward functions that fail on purpose, loaded by the reward service's workers in the fault scenarios
(`python_function` scorer, TRL signature). Prompts are "say <i> now"; every fifth prompt misbehaves."""

from __future__ import annotations

import time
from typing import Any


def _length_reward(completions: list[str]) -> list[float]:
    return [-abs(len(c) - 4) / 4 for c in completions]


def _misbehaves(prompt: Any) -> bool:
    return int(str(prompt).split()[1]) % 5 == 0


def raises_sometimes(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    if any(_misbehaves(p) for p in prompts):
        raise RuntimeError("scorer bug on purpose")
    return _length_reward(completions)


def hangs_sometimes(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    if any(_misbehaves(p) for p in prompts):
        time.sleep(3600)  # past any deadline: the reward service must kill it
    return _length_reward(completions)
