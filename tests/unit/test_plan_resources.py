"""`[resources]` of a run file and `rlfabric plan --devices`: memory sizes with units, the short device
syntax, and the validators that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlfabric.plan.resources import (
    ResourcesSpec,
    format_bytes,
    parse_devices,
    parse_memory,
    resources_from_devices,
)
from rlfabric.runspec import RunSpec

GIB = 1 << 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GIB),
        ("23GB", 23 * 10**9),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 * GIB // 2),
        ("4096", 4096),
    ],
)
def test_memory_takes_decimal_and_binary_units(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["80 gigs", "GiB", "-1GiB", ""])
def test_a_memory_size_without_a_known_unit_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected bytes like"):
        parse_memory(text)


def test_format_bytes_picks_the_largest_binary_unit() -> None:
    assert format_bytes(80 * GIB) == "80.0 GiB"
    assert format_bytes(-(3 << 20)) == "-3.0 MiB"
    assert format_bytes(12) == "12 B"


def test_the_run_spec_takes_a_resources_section_with_unit_strings() -> None:
    spec = RunSpec.model_validate(
        {
            "model": {"path": "m"},
            "dataset": {"path": "d"},
            "resources": {
                "learner": {"devices": 2, "memory": "80GiB"},
                "rollout": {"devices": 4, "memory": 2**34},
            },
        }
    )
    assert spec.resources is not None
    assert spec.resources.learner.memory == 80 * GIB
    assert spec.resources.rollout_group().devices == 4
    assert RunSpec.model_validate({"model": {"path": "m"}, "dataset": {"path": "d"}}).resources is None


def test_a_bad_device_kind_names_the_field() -> None:
    with pytest.raises(ValidationError, match=r"learner\.kind"):
        ResourcesSpec.model_validate({"learner": {"kind": "gpu", "memory": "1GiB"}})


def test_colocated_roles_must_share_the_learners_devices() -> None:
    data = {
        "placement": "colocated",
        "learner": {"devices": 2, "memory": "80GiB"},
        "rollout": {"devices": 2, "memory": "40GiB"},
    }
    with pytest.raises(ValidationError, match=r"resources\.rollout"):
        ResourcesSpec.model_validate(data)


def test_default_rollout_is_one_replica_per_device_colocated_and_one_disaggregated() -> None:
    colocated = ResourcesSpec.model_validate(
        {"placement": "colocated", "learner": {"devices": 8, "memory": 1}}
    )
    assert colocated.rollout_group().devices == 8
    apart = ResourcesSpec.model_validate({"learner": {"devices": 8, "memory": 1}})
    assert apart.rollout_group().devices == 1


def test_devices_with_roles_are_disaggregated() -> None:
    data = parse_devices("learner=2xcuda:80GiB,rollout=4xcuda:40GiB,reward=1xcpu:16GB")
    spec = ResourcesSpec.model_validate(data)
    assert spec.placement == "disaggregated"
    assert (spec.learner.devices, spec.learner.memory) == (2, 80 * GIB)
    assert spec.rollout is not None and (spec.rollout.devices, spec.rollout.memory) == (4, 40 * GIB)
    assert spec.reward is not None and (spec.reward.kind, spec.reward.memory) == ("cpu", 16 * 10**9)


def test_devices_without_a_role_colocate_everything() -> None:
    spec = ResourcesSpec.model_validate(parse_devices("1xcpu:23GiB"))
    assert spec.placement == "colocated"
    assert (spec.learner.kind, spec.learner.devices, spec.learner.memory) == ("cpu", 1, 23 * GIB)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learner=2xcuda", "expected"),
        ("critic=1xcuda:1GiB,learner=1xcuda:1GiB", "unknown role"),
        ("rollout=1xcuda:1GiB", "name the learner"),
        ("learner=1xcuda:1GiB,learner=2xcuda:1GiB", "given twice"),
        ("2xcuda:1GiB,learner=1xcuda:1GiB", "not both"),
    ],
)
def test_bad_device_specs_are_refused_naming_the_item(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_devices(text)


def test_devices_keep_the_declared_rollout_concurrency() -> None:
    declared = ResourcesSpec.model_validate(
        {"learner": {"memory": 1}, "rollout": {"devices": 1, "memory": 1, "concurrency": 12}}
    )
    spec = resources_from_devices("learner=2xcuda:80GiB,rollout=3xcuda:80GiB", declared)
    assert spec.rollout is not None and (spec.rollout.devices, spec.rollout.concurrency) == (3, 12)
