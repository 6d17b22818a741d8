"""`rlfabric.runtime.credentials`: the refusal names variables the config loader really reads, `--insecure`
warns, and the agreed credential of each service is where its variable puts it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from rlfabric.cli import SERVICES
from rlfabric.runtime.config import ConfigError, load_config
from rlfabric.runtime.credentials import Credential, MissingCredential, require_credentials

# (service, config key, variable) as agreed for issue 17; the variable must land on the key.
AGREED = [
    ("reward", "token", "RLFABRIC_REWARD__TOKEN"),
    ("coordinator", "api.token", "RLFABRIC_COORDINATOR__API__TOKEN"),
    ("coordinator", "reward_token", "RLFABRIC_COORDINATOR__REWARD_TOKEN"),
    ("coordinator", "learner_token", "RLFABRIC_COORDINATOR__LEARNER_TOKEN"),
    ("coordinator", "rollout_token", "RLFABRIC_COORDINATOR__ROLLOUT_TOKEN"),
    ("rollout", "learner_token", "RLFABRIC_ROLLOUT__LEARNER_TOKEN"),
    ("rollout", "client_token", "RLFABRIC_ROLLOUT__CLIENT_TOKEN"),
    ("learner", "publish_token", "RLFABRIC_LEARNER__PUBLISH_TOKEN"),
    ("learner", "token", "RLFABRIC_LEARNER__TOKEN"),
]
REQUIRED = {  # the smallest valid config of each service (no credentials)
    "reward": {},
    "coordinator": {},
    "rollout": {"engine": {"model": "m"}},
    "learner": {"run_id": "r", "run": {"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}}},
}


def configured(service: str, environ: dict[str, str]) -> object:
    entry = SERVICES[service]
    overrides = [f"{k}={v}" for k, v in flatten(REQUIRED[service])]
    return load_config(
        entry.config_model(), overrides=overrides, env_prefix=entry.env_prefix, environ=environ
    )


def flatten(data: dict[str, object], prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            rows += flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def lookup(config: object, dotted: str) -> object:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize(("service", "key", "variable"), AGREED)
def test_each_agreed_variable_sets_its_key(service: str, key: str, variable: str) -> None:
    assert Credential(key, None).env_var(service) == variable
    assert lookup(configured(service, {}), key) is None  # no default token
    assert lookup(configured(service, {variable: "t0ken"}), key) == "t0ken"


@pytest.mark.parametrize("service", sorted(REQUIRED))
def test_insecure_defaults_off(service: str) -> None:
    assert lookup(configured(service, {}), "insecure") is False


def test_the_replica_and_the_coordinator_require_the_replicas_client_token() -> None:
    from rlfabric.coordinator.main import credentials as coordinator_credentials
    from rlfabric.rollout.main import credentials as rollout_credentials

    rollout = rollout_credentials(configured("rollout", {}))  # type: ignore[arg-type]
    assert [c.key for c in rollout] == ["learner_token", "client_token"]
    coordinator = coordinator_credentials(configured("coordinator", {}))  # type: ignore[arg-type]
    assert [c.key for c in coordinator] == ["api.token", "reward_token", "rollout_token"]


def test_an_empty_token_is_a_config_error_not_no_token() -> None:
    with pytest.raises(ConfigError, match="token"):
        configured("reward", {"RLFABRIC_REWARD__TOKEN": ""})


def test_missing_credentials_are_named_in_one_line() -> None:
    needed = [
        Credential("api.token", None),
        Credential("reward_token", "set"),
        Credential("learner_token", None),
    ]
    with pytest.raises(MissingCredential) as info:
        require_credentials("coordinator", needed, insecure=False)
    message = str(info.value)
    assert "\n" not in message
    assert "RLFABRIC_COORDINATOR__API__TOKEN and RLFABRIC_COORDINATOR__LEARNER_TOKEN" in message
    assert "REWARD_TOKEN" not in message and "--insecure" in message
    assert isinstance(info.value, ConfigError)  # the CLI prints it and exits 2


def test_given_credentials_pass_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        require_credentials("reward", [Credential("token", "t")], insecure=False)
    assert caplog.records == []


def test_insecure_passes_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        require_credentials("rollout", [Credential("learner_token", None)], insecure=True)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "--insecure" in record.getMessage()


@pytest.mark.parametrize(("flags", "expected"), [((), False), (("--insecure",), True)])
def test_serve_insecure_flag_sets_the_config_key(flags: tuple[str, ...], expected: bool) -> None:
    argv = [sys.executable, "-m", "rlfabric.cli", "serve", "reward", *flags, "--print-config"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["insecure"] is expected
