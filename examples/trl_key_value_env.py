"""A key-value lookup environment written for TRL's `GRPOTrainer(environment_factory=KeyValueEnv)`.

Nothing here knows rlfabric: the environment service runs it unchanged (`kind = "trl"`, see
docs/environment.md). Each dataset row holds `facts` (a key -> value object) and the `key` asked about;
the model looks keys up, answers with `answer`, and `get_reward` says whether the answer was right.
"""

from __future__ import annotations

import asyncio


class KeyValueEnv:
    """One rollout's store of facts; TRL makes one per rollout and calls `reset` with the row's columns."""

    def __init__(self) -> None:
        self.facts: dict[str, str] = {}
        self.key = ""
        self.answered: str | None = None

    def reset(self, **kwargs) -> str | None:
        self.facts = dict(kwargs.get("facts", {}))
        self.key = kwargs.get("key", "")
        self.answered = None
        if not self.facts:
            return None
        return f"\nKeys you may look up: {', '.join(sorted(self.facts))}."

    def lookup(self, key: str) -> str:
        """Looks a key up in the store.

        Args:
            key: The key to look up.

        Returns:
            The value stored under the key.
        """
        if key not in self.facts:
            raise ValueError(f"no key {key!r}")
        return self.facts[key]

    async def count(self, prefix: str, limit: int = 10) -> int:
        """Counts the keys that start with a prefix.

        Args:
            prefix: The start of the keys to count.
            limit: The most keys to count.
        """
        await asyncio.sleep(0)
        return min(limit, sum(k.startswith(prefix) for k in self.facts))

    def answer(self, value: str) -> dict:
        """Gives the final answer: the value asked for.

        Args:
            value: The value of the key asked about.
        """
        self.answered = value
        return {"recorded": value}

    @property
    def solved(self) -> bool:
        return self.answered == self.facts.get(self.key)

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0

    def _log(self, text: str) -> None:
        print(text)


def make_env() -> KeyValueEnv:
    """A zero-argument factory, the other form TRL's `environment_factory` takes."""
    return KeyValueEnv()
