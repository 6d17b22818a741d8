"""Every `rlfabric ...` command the run-file schema's docstrings name is a real command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rlfabric.runspec
from rlfabric.cli import build_parser

COMMAND = re.compile(r"`rlfabric ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)")


def named_commands() -> list[str]:
    text = "".join(path.read_text() for path in Path(rlfabric.runspec.__file__).parent.glob("*.py"))
    return sorted(set(COMMAND.findall(text)))


def test_the_schema_names_commands() -> None:
    assert "reward list" in named_commands()


@pytest.mark.parametrize("command", named_commands())
def test_a_named_command_exists(command: str) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*command.split(), "--help"])
    assert done.value.code == 0, f"`rlfabric {command}` is not a command"
