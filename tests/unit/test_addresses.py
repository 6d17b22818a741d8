"""The address a service announces (`runtime.addresses`) and the rollout replica's `advertise_address`."""

from __future__ import annotations

import pytest

from rlfabric.rollout.config import RolloutServiceConfig
from rlfabric.runtime.addresses import announced_address, route_source, split_host_port
from rlfabric.runtime.config import ConfigError, load_config

MODEL = "engine.model=m"


def rollout(*overrides: str, environ: dict[str, str] | None = None) -> RolloutServiceConfig:
    return load_config(
        RolloutServiceConfig, overrides=[MODEL, *overrides], env_prefix="RLFABRIC_ROLLOUT__", environ=environ
    )


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("h:1", ("h", 1)),
        ("h", ("h", None)),
        ("10.0.0.5:50051", ("10.0.0.5", 50051)),
        ("[::1]:7", ("::1", 7)),
        ("[fd00::2]", ("fd00::2", None)),
        ("fd00::2", ("fd00::2", None)),
    ],
)
def test_split_host_port(address: str, expected: tuple[str, int | None]) -> None:
    assert split_host_port(address) == expected


def test_the_bind_host_is_announced_unless_an_advertise_address_is_set() -> None:
    assert announced_address("10.0.0.5", 50051, None) == "10.0.0.5:50051"
    assert announced_address("::1", 7, None) == "[::1]:7"
    assert announced_address("0.0.0.0", 50051, "rollout-0") == "rollout-0:50051"  # the bound port
    assert announced_address("0.0.0.0", 50051, "203.0.113.9:31001") == "203.0.113.9:31001"  # NAT
    with pytest.raises(ValueError, match="advertise_address"):
        announced_address("0.0.0.0", 50051, None)


def test_rollout_advertises_its_bind_host_by_default() -> None:
    config = rollout("server.host=10.0.0.5")
    assert config.advertise_address is None
    assert announced_address(config.server.host, 1, config.advertise_address) == "10.0.0.5:1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_rollout_on_every_interface_without_an_advertise_address_is_refused_at_start(host: str) -> None:
    with pytest.raises(ConfigError, match="advertise_address"):
        rollout(f"server.host='{host}'")


def test_rollout_advertise_address_from_the_environment() -> None:
    env = {"RLFABRIC_ROLLOUT__ADVERTISE_ADDRESS": "10.231.7.3", "RLFABRIC_ROLLOUT__SERVER__HOST": "0.0.0.0"}
    config = rollout(environ=env)
    assert config.advertise_address == "10.231.7.3"
    assert announced_address(config.server.host, 50051, config.advertise_address) == "10.231.7.3:50051"


@pytest.mark.parametrize("value", ["0.0.0.0", "::", "h:99999", "h:port", ":50051"])
def test_an_advertise_address_no_client_can_dial_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="advertise_address"):
        rollout(f"advertise_address='{value}'")


def test_route_source_of_a_local_address_is_that_address() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("localhost") == "127.0.0.1"
