"""Shared helpers for the reward scorer unit tests."""

from typing import Any

import pytest

from rlfabric.reward.scorers import ScoreInput


def make_item(completion: str, reference: str = "", prompt: Any = "Q?", **metadata: Any) -> ScoreInput:
    return ScoreInput(id="i", prompt=prompt, completion=completion, reference=reference, metadata=metadata)


@pytest.fixture
def item():
    return make_item
