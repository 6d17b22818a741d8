"""docker-compose.yml: every rlfabric container's command line and environment load through the real CLI
and config loader (the same check as the Kubernetes manifests), and the pieces agree with each other."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_manifests import REPO, check_command, is_rlfabric_image, localize

COMPOSE = REPO / "docker-compose.yml"


def interpolate(text: str) -> str:
    """Compose's ${VAR}, ${VAR:-default} and $$, with an empty environment (the defaults apply)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return match.group(2) or ""

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}", one, text)


def services() -> dict[str, dict[str, Any]]:
    return dict(yaml.safe_load(interpolate(COMPOSE.read_text()))["services"])


def rlfabric_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services().items() if is_rlfabric_image(s["image"])}


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> file content for `./repo/path:/container/path[:ro]` volumes."""
    files = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./") and (REPO / source).is_file():
            files[target] = (REPO / source).read_text()
    return files


def config_of(name: str, tmp_path: Path) -> dict[str, Any]:
    service = rlfabric_services()[name]
    argv = localize(list(service["command"]), bind_mounts(service), tmp_path)
    config = check_command(argv, {k: str(v) for k, v in service.get("environment", {}).items()}, name)
    assert config is not None
    return config


def test_every_rlfabric_command_loads_through_the_cli(tmp_path: Path) -> None:
    found = rlfabric_services()
    assert {"reward", "rollout-0", "rollout-1", "learner", "coordinator", "submit", "model"} <= set(found)
    for name, service in found.items():
        argv = localize(list(service["command"]), bind_mounts(service), tmp_path)
        check_command(argv, {k: str(v) for k, v in service.get("environment", {}).items()}, name)


@pytest.mark.parametrize("name", ["rollout-0", "rollout-1"])
def test_replicas_register_an_address_the_coordinator_can_dial(name: str, tmp_path: Path) -> None:
    config = config_of(name, tmp_path)
    service = rlfabric_services()[name]
    assert config["server"]["host"] == service["hostname"] == name
    assert config["replica_id"] == name
    assert (
        service["environment"]["RLFABRIC_HEALTHCHECK"]
        == f"grpc://{name}:{config['server']['port']}/rlfabric.v1.RolloutService"
    )


def test_the_learner_trains_the_submitted_run_and_replicas_follow_it(tmp_path: Path) -> None:
    from rlfabric.runspec import RunSpec

    run = RunSpec.model_validate(yaml.safe_load((REPO / "deploy/compose/run.yaml").read_text()))
    learner = config_of("learner", tmp_path)
    assert RunSpec.model_validate(learner["run"]) == run and learner["run_id"] == run.name
    rollout = config_of("rollout-0", tmp_path)
    assert rollout["run_id"] == run.name
    assert rollout["weights_root"] == f"{run.output_dir}/{run.name}/weights"  # the learner's default
    assert rollout["engine"]["model"] == run.model.path


def test_the_coordinator_reaches_reward_and_reads_the_dataset(tmp_path: Path) -> None:
    from rlfabric.runspec import RunSpec
    from rlfabric.runtime.paths import Roots, violations

    coordinator = config_of("coordinator", tmp_path)
    reward = config_of("reward", tmp_path)
    assert coordinator["reward_address"] == f"reward:{reward['server']['port']}"
    assert coordinator["api"]["token"]
    run = RunSpec.model_validate(yaml.safe_load((REPO / "deploy/compose/run.yaml").read_text()))
    mounts = [v.split(":")[1] for v in rlfabric_services()["coordinator"]["volumes"]]
    assert run.dataset.path in mounts
    roots = Roots.of(coordinator["data_roots"], coordinator["model_roots"])
    assert violations(run, roots) == []  # the coordinator accepts the run's paths


def test_every_service_holds_its_credentials_and_both_ends_agree(tmp_path: Path) -> None:
    """No service runs `--insecure`; each credential is set, and what one service requires is what its
    caller presents."""
    configs = {
        n: config_of(n, tmp_path) for n in ("reward", "rollout-0", "rollout-1", "learner", "coordinator")
    }
    for name, config in configs.items():
        assert config["insecure"] is False and "--insecure" not in rlfabric_services()[name]["command"]
    coordinator, learner = configs["coordinator"], configs["learner"]
    assert coordinator["api"]["token"]
    assert configs["reward"]["token"] and coordinator["reward_token"] == configs["reward"]["token"]
    assert learner["token"] and coordinator["learner_token"] == learner["token"]
    for replica in ("rollout-0", "rollout-1"):
        assert (
            configs[replica]["learner_token"]
            and configs[replica]["learner_token"] == learner["publish_token"]
        )
        assert (
            configs[replica]["client_token"]
            and coordinator["rollout_token"] == configs[replica]["client_token"]
        )
        assert configs[replica]["client_token"] != configs[replica]["learner_token"]


def test_redis_is_durable_and_never_evicts() -> None:
    command = services()["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
