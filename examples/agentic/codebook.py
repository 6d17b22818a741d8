"""The agentic example's task: a code book the model can only read through a tool.

Each task names a person; the answer is that person's secret word, which changes from task to task, so
no policy can know it without calling `lookup` (an environment written for TRL's `environment_factory`:
`rlfabric` runs it unchanged, `kind = "trl"`) and copying what the tool returns into its final answer.
A turn: the model calls `<tool_call>{"name": "lookup", "arguments": {"name": "alice"}}</tool_call>`, the
environment answers with the word, the model answers with the word. `secret_word_reward` (a TRL-style
reward function) scores the final answer: 1 for the word exactly, else 0.

No rlfabric import here: the same class and reward function run in TRL's GRPOTrainer.
"""

from __future__ import annotations

from typing import Any

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi",
         "ivan", "judy", "karl", "lena", "mike", "nina", "oscar", "paula"]  # fmt: skip
WORDS = ["red", "blue", "green", "black", "white", "gold", "pink", "gray", "sun", "moon", "star", "rain",
         "snow", "wind", "fire", "sea", "tree", "rock", "sand", "leaf", "bird", "fish", "wolf", "bear",
         "lion", "frog", "milk", "bread", "salt", "rice", "corn", "plum", "door", "road", "ship", "boat",
         "bell", "drum", "lamp", "coin", "king", "queen", "cat", "dog", "cow", "owl", "bee",
         "ant"]  # fmt: skip


class CodeBook:
    """One episode's code book: only the task's person has a word."""

    def reset(self, name: str = "", word: str = "", **row: Any) -> None:
        self.name, self.word, self.calls = name, word, 0

    def lookup(self, name: str) -> str:
        """Look up the secret word of a person in the code book.

        Args:
            name: The person's name.

        Returns:
            The person's secret word.
        """
        self.calls += 1
        if name.strip().lower() != self.name:
            raise KeyError(f"no entry for {name}")  # the model sees it as the tool's error; a failed call
        return self.word


def secret_word_reward(completions: list[Any], word: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the final answer is the task's secret word (spaces and a final period ignored)."""
    answers = [_text(c).strip().rstrip(".").strip().lower() for c in completions]
    return [1.0 if answer == w else 0.0 for answer, w in zip(answers, word, strict=True)]


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # TRL's conversational completions: the last message's content
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)
