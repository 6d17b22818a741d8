"""A configuration error names where each bad value came from: the file, the environment variable, the
`--set` key or the command-line flag, never "defaults" for a value someone set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfabric.prefs.spec import PipelineSpec
from rlfabric.reward.config import RewardServiceConfig
from rlfabric.rollout.config import RolloutServiceConfig
from rlfabric.runspec import RunSpec
from rlfabric.runtime.config import ConfigError, Origins, load_config, read_file, validate

PREFIX = "RLFABRIC_REWARD__"


def message(**layers: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(RewardServiceConfig, env_prefix=PREFIX, **layers)
    return str(info.value)


def header(text: str) -> str:
    return text.splitlines()[0]


def test_a_bad_environment_variable_is_named() -> None:
    text = message(environ={f"{PREFIX}WORKERS": "lots"})
    assert header(text) == f"invalid configuration (environment variable {PREFIX}WORKERS):"
    assert "workers:" in text and "'lots'" in text and "defaults" not in text


def test_a_bad_file_value_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "reward.toml"
    path.write_text("workers = 'many'\n")
    assert header(message(path=path, environ={})) == f"invalid configuration ({path}):"


def test_a_bad_set_override_names_its_key() -> None:
    assert header(message(overrides=["workers=0"], environ={})) == "invalid configuration (--set workers):"


def test_a_bad_flag_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            RolloutServiceConfig,
            overrides=["engine.model=m"],
            explicit={"engine.kind": "nope"},
            flags={"engine.kind": "--engine"},
        )
    assert header(str(info.value)) == "invalid configuration (--engine):"


def test_a_flag_without_a_name_is_named_by_its_key() -> None:
    with pytest.raises(ConfigError, match=r"\(the flag for server\.host\)"):
        load_config(RewardServiceConfig, explicit={"server.host": 5})


def test_a_later_layer_takes_the_blame_only_for_what_it_set(tmp_path: Path) -> None:
    path = tmp_path / "reward.toml"
    path.write_text("workers = 'many'\n[server]\nport = 'x'\n")
    text = message(path=path, environ={f"{PREFIX}WORKERS": "lots"})
    assert header(text) == f"invalid configuration ({path}, environment variable {PREFIX}WORKERS):"
    lines = text.splitlines()[1:]
    assert [line.rsplit(" [", 1)[1] for line in lines] == [
        f"{path}]",
        f"environment variable {PREFIX}WORKERS]",
    ]
    assert lines[0].startswith("  server.port:") and lines[1].startswith("  workers:")


def test_an_environment_variable_that_fixes_the_file_leaves_no_error(tmp_path: Path) -> None:
    path = tmp_path / "reward.toml"
    path.write_text("workers = 'many'\n")
    config = load_config(RewardServiceConfig, path=path, env_prefix=PREFIX, environ={f"{PREFIX}WORKERS": "3"})
    assert config.workers == 3


def test_a_table_replaced_by_a_later_layer_is_blamed_on_it(tmp_path: Path) -> None:
    path = tmp_path / "reward.toml"
    path.write_text("[server]\nport = 7001\n")
    text = message(path=path, environ={f"{PREFIX}SERVER": "{port: x}"})
    assert header(text) == f"invalid configuration (environment variable {PREFIX}SERVER):"


def test_a_rule_across_fields_names_the_sources_of_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\npath = "m"\n[dataset]\npath = "d"\n[rollout.sampling]\nn = 4\n')
    with pytest.raises(ConfigError) as info:
        load_config(RunSpec, path=path, overrides=["rollout.sampling.n=1"])
    assert header(str(info.value)) == f"invalid configuration ({path}, --set rollout.sampling.n):"


def test_a_value_inside_a_tagged_union_is_traced() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(PipelineSpec, overrides=["name=p", "source.kind=file", "source.path=3"])
    assert header(str(info.value)) == "invalid configuration (--set source.path):"
    assert "source.file.path:" in str(info.value)  # pydantic's location holds the union's tag


def test_a_missing_field_names_the_file_as_before(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\n")
    with pytest.raises(ConfigError) as info:
        load_config(RunSpec, path=path)
    assert header(str(info.value)) == f"invalid configuration ({path}):"


def test_a_value_no_layer_set_is_from_the_defaults() -> None:
    assert Origins().of(("server", "port")) == ["defaults"]


def test_validating_one_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "reward.toml"
    path.write_text("workers = 'many'\n[server]\nport = 'x'\n")
    with pytest.raises(ConfigError) as info:
        validate(RewardServiceConfig, read_file(path), str(path))
    assert header(str(info.value)) == f"invalid configuration ({path}):"
    assert " [" not in str(info.value)  # one source: no per-line tags


def serve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", "serve", *args, "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_serve_names_the_environment_variable() -> None:
    result = serve("reward", RLFABRIC_REWARD__WORKERS="lots")
    assert result.returncode == 2
    assert "invalid configuration (environment variable RLFABRIC_REWARD__WORKERS)" in result.stderr


def test_serve_names_the_flag() -> None:
    result = serve("rollout", "--model", "m", "--engine", "nope")
    assert result.returncode == 2
    assert "invalid configuration (--engine)" in result.stderr
