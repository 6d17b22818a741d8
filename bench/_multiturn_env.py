"""The 4-turn task of `bench/multiturn.py`: a user planning a trip asks four questions, one per model turn.

`TripPlanner` is an in-process environment (`rlfabric.environment.base.Environment`): `reset` shows a
system message and the first question, each `step` answers the model's turn with the next question (a
short user message), and the step after the last question ends the episode. It reads nothing of what the
model wrote, so every trajectory has exactly `turns` model turns unless a limit cuts it, whichever loop
drives it. The reward (on the last step) is the share of the model's turns that were short (at most 32
characters): something a policy could learn, and a figure to compare at equal reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfabric.environment.base import Environment
from rlfabric.environment.types import Observation, StepResult

SYSTEM = "You are a helpful travel assistant. Answer each question in one or two sentences."
CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima")
MONTHS = ("March", "June", "September", "December")
FOLLOW_UPS = (
    "Thanks. What should we pack for {days} days?",
    "Good. Which museum should we visit first?",
    "Last question: how do we get from the airport to the centre?",
)
SHORT_CHARS = 32


def make_tasks(count: int, turns: int = 4) -> list[dict[str, Any]]:
    """`count` distinct tasks (the dataset rows both loops play)."""
    return [
        {
            "city": CITIES[i % len(CITIES)],
            "month": MONTHS[(i // len(CITIES)) % len(MONTHS)],
            "days": 3 + i % 5,
            "turns": turns,
        }
        for i in range(count)
    ]


class TripPlanner(Environment):
    """One episode of the task (module docstring)."""

    def reset(self, task: Mapping[str, Any], *, seed: int | None = None) -> Observation:
        self.task, self.turn, self.short = dict(task), 0, 0
        question = f"We plan a trip to {task['city']} in {task['month']}. What is the weather like then?"
        return Observation([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

    def step(self, action: str) -> StepResult:
        self.turn += 1
        self.short += len(action.strip()) <= SHORT_CHARS
        if self.turn >= int(self.task["turns"]):
            return StepResult([], reward=self.short / self.turn, done=True)
        follow_up = FOLLOW_UPS[(self.turn - 1) % len(FOLLOW_UPS)].format(days=self.task["days"])
        return StepResult([{"role": "user", "content": follow_up}])


# --- the same shape of task for TRL's environment_factory (bench/multiturn_e2e.py) ----------------------
#
# TRL's multi-turn loop goes on only while the model calls tools, so there the four model turns are three
# tool calls and an answer: the model reads three secret words, one `read_word` call a turn, then answers
# with the three words. `words_reward` (a TRL-signature reward function, the same object on both sides)
# scores the final answer.

WORDS = ("red", "blue", "green", "gold", "pink", "gray", "sun", "moon", "star", "rain", "snow", "sea")
WORDINGS = (
    "Read the three secret words, then tell me all three.",
    "There are three secret words. Read them and repeat them.",
    "Tell me the three secret words, in the order you read them.",
)


def word_tasks(count: int, seed: int) -> list[dict[str, str]]:
    """`count` rows: prompt (text) and answer (three words, space-separated, in reading order)."""
    import random

    rng = random.Random(seed)
    return [
        {"prompt": rng.choice(WORDINGS), "answer": " ".join(rng.choice(WORDS) for _ in range(3))}
        for _ in range(count)
    ]


class SecretWords:
    """An environment written for TRL's `GRPOTrainer(environment_factory=SecretWords)`: one episode's
    three secret words, read one a call. rlfabric runs it unchanged (`kind = "trl"`)."""

    def reset(self, answer: str = "", **row: Any) -> None:
        self.words, self.read = answer.split(), 0

    def read_word(self):  # type: ignore[no-untyped-def]  # no return hint: TRL's schema = rlfabric's
        """Read the next secret word."""
        if self.read >= len(self.words):
            return "no more words"
        self.read += 1
        return self.words[self.read - 1]


def words_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """The share of the three words the final answer gives in their places (1.0: all three, in order)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        given = _final_text(completion).replace(",", " ").replace(".", " ").lower().split()
        wanted = expected.split()
        rewards.append(sum(g == w for g, w in zip(given, wanted, strict=False)) / len(wanted))
    return rewards


def _final_text(completion: Any) -> str:
    """The final answer: rlfabric passes the last model turn's text; TRL the completion's messages, whose
    last assistant message is the answer (a tool message can come last when TRL cut the completion)."""
    if isinstance(completion, list):
        answers = [m for m in completion if m.get("role") == "assistant"]
        return str(answers[-1].get("content") or "") if answers else ""
    return str(completion)
