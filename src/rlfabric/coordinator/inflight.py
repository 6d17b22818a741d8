"""A group between the cursor and the stream, and the two ways its generation fails."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InFlight:
    """A group taken from the cursor and not yet enqueued or dropped (persisted in Redis)."""

    group_id: str
    prompt_id: str
    epoch: int
    position: int
    attempts: int = 0


class ReplicaFailed(RuntimeError):
    """Generation failed on one replica (it died, was refused, timed out): re-dispatch the group."""


class InvalidPrompt(ValueError):
    """The replica refused the prompt itself (too long for the context, empty): drop the group, never
    retry it and never blame the replica. `too_long`: the refusal says the prompt leaves no room for
    `max_tokens` (`wire.is_prompt_too_long`)."""

    def __init__(self, message: str, *, too_long: bool = False) -> None:
        super().__init__(message)
        self.too_long = too_long
