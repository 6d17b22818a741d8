"""Configuration: files in three formats, clear errors naming the field, and override precedence."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlfabric.common.config import ConfigError, load_config
from rlfabric.common.runspec import RunSpec
from rlfabric.reward.config import RewardServiceConfig
from rlfabric.rollout.config import RolloutServiceConfig

RUN_TOML = """
[model]
path = "models/tiny"

[dataset]
path = "data/prompts.jsonl"

[rollout.sampling]
n = 4
max_tokens = 32

[reward]
scorer = "math_verify"
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_good_run_file_keeps_defaults_for_unset_fields(tmp_path: Path) -> None:
    spec = load_config(RunSpec, path=write(tmp_path, "run.toml", RUN_TOML))
    assert spec.model.path == "models/tiny"
    assert spec.rollout.sampling.n == 4
    assert spec.rollout.sampling.temperature == 1.0
    assert spec.algorithm.advantage == "grpo"
    assert spec.rollout.max_staleness == 1


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_yaml_and_json_files_load_the_same_spec(tmp_path: Path, suffix: str) -> None:
    data = {"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}, "rollout": {"sampling": {"n": 3}}}
    text = json.dumps(data) if suffix == ".json" else "model: {path: m}\ndataset: {path: d.jsonl}\n"
    if suffix == ".yaml":
        text += "rollout:\n  sampling:\n    n: 3\n"
    spec = load_config(RunSpec, path=write(tmp_path, f"run{suffix}", text))
    assert (spec.model.path, spec.rollout.sampling.n) == ("m", 3)


def test_unknown_field_is_an_error_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path, "run.toml", RUN_TOML + "\n[optim]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(RunSpec, path=path)
    assert "optim.learning_rate" in str(info.value)
    assert "Extra inputs are not permitted" in str(info.value)


def test_bad_type_is_an_error_naming_field_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "run.toml", RUN_TOML.replace("n = 4", 'n = "four"'))
    with pytest.raises(ConfigError) as info:
        load_config(RunSpec, path=path)
    message = str(info.value)
    assert "rollout.sampling.n" in message
    assert "'four'" in message
    assert str(path) in message


def test_missing_required_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dataset: Field required"):
        load_config(RunSpec, path=write(tmp_path, "run.yaml", "model: {path: m}\n"))


def test_cross_field_rule_group_estimator_needs_two_samples(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.n must be >= 2"):
        load_config(RunSpec, path=write(tmp_path, "run.toml", RUN_TOML), overrides=["rollout.sampling.n=1"])


def test_broken_file_syntax_is_reported_with_the_path(tmp_path: Path) -> None:
    path = write(tmp_path, "run.toml", "[model\npath=")
    with pytest.raises(ConfigError, match="not valid toml"):
        load_config(RunSpec, path=path)


def test_override_precedence_file_env_set_flags(tmp_path: Path) -> None:
    file_text = "[server]\nport = 1000\nhost = '10.0.0.1'\nmax_concurrent_rpcs = 7\n"
    path = write(tmp_path, "reward.toml", file_text)
    env = {
        "RLFABRIC_REWARD__SERVER__PORT": "2000",
        "RLFABRIC_REWARD__SERVER__MAX_CONCURRENT_RPCS": "9",
        "RLFABRIC_REWARD__WORKERS": "3",
        "UNRELATED": "x",
    }
    config = load_config(
        RewardServiceConfig,
        path=path,
        env_prefix="RLFABRIC_REWARD__",
        environ=env,
        overrides=["server.port=3000", "item_timeout_s=2.5"],
        explicit={"server.port": 4000, "server.host": None},
    )
    assert config.server.port == 4000  # the explicit flag beats --set, env and file
    assert config.item_timeout_s == 2.5  # --set
    assert config.server.max_concurrent_rpcs == 9  # env beats file
    assert config.workers == 3  # env
    assert config.server.host == "10.0.0.1"  # an unset flag (None) overrides nothing


def test_set_beats_env(tmp_path: Path) -> None:
    config = load_config(
        RewardServiceConfig,
        env_prefix="RLFABRIC_REWARD__",
        environ={"RLFABRIC_REWARD__WORKERS": "3"},
        overrides=["workers=5"],
    )
    assert config.workers == 5


def test_set_parses_lists_and_booleans() -> None:
    config = load_config(
        RolloutServiceConfig,
        overrides=["engine.model=m", "engine.enforce_eager=true", "engine.max_model_len=512"],
    )
    assert config.engine.enforce_eager is True
    assert config.engine.max_model_len == 512
    spec = load_config(
        RunSpec, overrides=["model.path=m", "dataset.path=d", 'rollout.sampling.stop=["</a>", "\\n\\n"]']
    )
    assert spec.rollout.sampling.stop == ["</a>", "\n\n"]


def test_malformed_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        load_config(RewardServiceConfig, overrides=["workers"])


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_cli_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, "reward.toml", "[server]\nport = 'abc'\n")
    result = run_cli("serve", "reward", "--config", str(path))
    assert result.returncode == 2
    assert "server.port" in result.stderr


def test_cli_print_config_applies_flags(tmp_path: Path) -> None:
    result = run_cli("serve", "reward", "--set", "workers=2", "--port", "7001", "--print-config")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert (config["server"]["port"], config["workers"]) == (7001, 2)


def test_cli_config_check_run_file(tmp_path: Path) -> None:
    good = run_cli("config", "check", str(write(tmp_path, "run.toml", RUN_TOML)))
    assert good.returncode == 0, good.stderr
    bad = run_cli("config", "check", str(write(tmp_path, "bad.toml", RUN_TOML + "\n[train]\nsteps = -1\n")))
    assert bad.returncode == 2
    assert "train.steps" in bad.stderr
