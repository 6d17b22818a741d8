"""Fixtures of the fault scenarios: a factory of whole-loop stacks, each stopped (by PID) after its test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_stack import Stack, run_spec


@pytest.fixture
def make_stack(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Callable[..., Stack]]:
    """`make_stack(engine=..., spec=run_spec overrides...)`: a Stack whose processes the test starts."""
    stacks: list[Stack] = []

    def make(
        *, engine: str = "transformers", vllm_env: dict[str, str] | None = None, **overrides: Any
    ) -> Stack:
        folder = tmp_path / f"stack{len(stacks)}"
        folder.mkdir()
        stack = Stack(folder, run_spec(folder, tiny_model_dir, **overrides), engine=engine, vllm_env=vllm_env)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()
