"""The hidden "gold" preference of the RLHF example: it stands in for the humans who label pairs.

The labellers want replies with plenty of the letter x, but they dislike stuttering: every character that
repeats the one before it costs as much as an x earns. For a reply of non-space characters c_1..c_n:

    gold = 2 * min(share of x, 0.5) - share of characters equal to their predecessor

so "xaxbxc" scores 1.0, "xxxxxx" about 0.17, and a random reply about 0.01. Pairs sampled from the initial
(random) policy differ mostly in how many x they hold, so a reward model trained on them learns "more x is
better" and keeps believing it where it saw no data; a policy trained against that model first gets
better by the gold measure too, then worse once its replies fill with x: the over-optimization curve.

`gold_reward` follows TRL's reward-function call (prompts=, completions=, **columns) and is used twice: as
the judge that labels the pairs (`prefs.toml`) and as the held-out evaluation's gold reward (`rl.toml`).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

TARGET = "x"


def gold_score(text: str) -> float:
    """The gold preference of one reply (see the module docstring); 0 for an empty reply."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    share_x = sum(c == TARGET for c in chars) / len(chars)
    repeats = sum(a == b for a, b in pairwise(chars)) / len(chars)
    return 2.0 * min(share_x, 0.5) - repeats


def gold_reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """TRL-style reward function: `gold_score` of each completion (the text of a conversational one)."""
    return [gold_score(c if isinstance(c, str) else c[-1]["content"]) for c in completions]
