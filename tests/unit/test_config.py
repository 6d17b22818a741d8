"""Configuration: files in three formats, clear errors naming the field, and override precedence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rlfabric.reward.config import RewardServiceConfig
from rlfabric.rollout.config import RolloutServiceConfig
from rlfabric.runspec import RunSpec
from rlfabric.runtime.config import ConfigError, load_config

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


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("[train]\nmicro_batch_size = true", "train.micro_batch_size"),  # was coerced to 1
        ('[train]\nsteps = "10"', "train.steps"),
        ("[train]\ngroups_per_step = 8.0", "train.groups_per_step"),
        ('[optim]\nlr = "0.1"', "optim.lr"),
        ("[optim]\nlr = inf", "optim.lr"),
        ("[optim]\nlr = nan", "optim.lr"),
        ("[rollout]\ndynamic_sampling = 1", "rollout.dynamic_sampling"),
        ("[train]\nseed = -1", "train.seed"),
    ],
)
def test_run_spec_types_are_strict(tmp_path: Path, line: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunSpec, path=write(tmp_path, "run.toml", RUN_TOML + "\n" + line + "\n"))
    assert field in str(info.value)


def test_strict_types_still_take_ints_for_floats_and_lists_for_betas(tmp_path: Path) -> None:
    extra = "[optim]\nlr = 1\nbetas = [0.9, 0.95]\n"
    spec = load_config(RunSpec, path=write(tmp_path, "run.toml", RUN_TOML + extra))
    assert spec.optim.lr == 1.0 and spec.optim.betas == (0.9, 0.95)
    again = RunSpec.model_validate_json(spec.model_dump_json())  # as the coordinator stores it
    assert again == spec


@pytest.mark.parametrize("text", ["optim: {lr: 1e-6}", "optim: {lr: 1E-6}", "optim: {lr: 1.0e-6}"])
def test_yaml_exponents_are_floats(tmp_path: Path, text: str) -> None:
    """YAML 1.1 reads `1e-6` as a string, which strict floats would refuse: the loader reads YAML 1.2."""
    spec = load_config(
        RunSpec, path=write(tmp_path, "run.yaml", "model: {path: m}\ndataset: {path: d}\n" + text)
    )
    assert spec.optim.lr == 1e-6
    assert (
        load_config(RunSpec, overrides=["model.path=m", "dataset.path=d", "optim.lr=3e-4"]).optim.lr == 3e-4
    )


def int_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """Every int field of `model` and its nested models, by dotted path."""
    found = []
    for name, info in model.model_fields.items():
        for kind in (info.annotation, *get_args(info.annotation)):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += int_fields(kind, f"{prefix}{name}.")
            elif kind is int:
                found.append((f"{prefix}{name}", info))
    return found


def test_every_integer_of_the_run_spec_has_an_upper_bound() -> None:
    fields = int_fields(RunSpec)
    assert len(fields) >= 20 and "train.micro_batch_size" in dict(fields)
    unbounded = [name for name, info in fields if not any(hasattr(m, "le") for m in info.metadata)]
    assert unbounded == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("model.max_model_len", 197_000_000_000_000_000_000_000), ("train.groups_per_step", 47_000_000_000_000)],
)
def test_absurd_sizes_are_refused(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(RunSpec, overrides=["model.path=m", "dataset.path=d", f"{field}={value}"])


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
    online = {**os.environ, "HF_HUB_OFFLINE": "0"}  # models/tiny may be a hub id it could download
    good = run_cli("config", "check", str(write(tmp_path, "run.toml", RUN_TOML)), env=online)
    assert good.returncode == 0, good.stderr
    bad = run_cli("config", "check", str(write(tmp_path, "bad.toml", RUN_TOML + "\n[train]\nsteps = -1\n")))
    assert bad.returncode == 2
    assert "train.steps" in bad.stderr


def test_cli_config_check_applies_set(tmp_path: Path) -> None:
    run_file = str(write(tmp_path, "run.toml", RUN_TOML))
    fixed = run_cli("config", "check", run_file, "--schema-only", "--set", "train.steps=3")
    assert fixed.returncode == 0, fixed.stderr
    bad = run_cli("config", "check", run_file, "--schema-only", "--set", "train.steps=-1")
    assert bad.returncode == 2 and "(--set train.steps)" in bad.stderr and "train.steps" in bad.stderr


def test_a_base_takes_the_files_place_and_errors_name_it() -> None:
    base = ({"server": {"port": 7001}, "workers": 0}, "the built-in spec")
    config = load_config(RewardServiceConfig, base=base, overrides=["workers=3"])
    assert (config.server.port, config.workers) == (7001, 3) and base[0]["workers"] == 0
    with pytest.raises(ConfigError, match=r"\(the built-in spec\)"):
        load_config(RewardServiceConfig, base=({"workers": -1}, "the built-in spec"))
