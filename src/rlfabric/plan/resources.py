"""The resources a run declares (`[resources]` of a run file): which devices each role runs on.

The memory planner (`rlfabric plan`, `rlfabric.plan.planner`) sums each role's memory on these devices;
`POST /v1/runs` and `rlfabric up` refuse a run that declares resources it cannot fit in. A run without a
`[resources]` section is never refused for memory. The same placement can be given on the command line
(`rlfabric plan --devices SPEC`, `parse_devices`):

    learner=2xcuda:80GiB,rollout=4xcuda:80GiB,reward=1xcuda:24GiB   disaggregated: each role its devices
    8xcuda:80GiB                                                      colocated: every role on the same 8
    1xcpu:23GiB                                                       colocated on one host's memory

Each item is `[ROLE=]COUNTxKIND:MEMORY`; MEMORY is bytes with an optional unit (B, KB, MB, GB, TB in
powers of 1000; KiB, MiB, GiB, TiB in powers of 1024). A rollout replica has one device.

This module imports no other part of rlfabric but the config base, so the run spec can import it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from rlfabric.runtime.config import StrictModel

MAX_DEVICES = 100_000
"""Upper bound of every device or replica count."""
MAX_MEMORY = 1 << 50
"""Upper bound of memory per device (1 PiB)."""
MAX_CONCURRENCY = 1_000_000
"""Upper bound of the sequences one rollout replica holds at once."""

UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
"""Memory units (upper-cased): decimal (KB ... TB) and binary (KiB ... TiB)."""
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_DEVICE_ITEM = re.compile(r"^(?:(?P<role>[a-z]+)=)?(?P<count>\d+)x(?P<kind>[a-z]+):(?P<memory>.+)$")

DeviceKind = Literal["cpu", "cuda"]
"""cpu: host memory (one "device" is a host's RAM); cuda: one NVIDIA GPU."""
Placement = Literal["colocated", "disaggregated"]
"""colocated: every role on the learner's devices; disaggregated: each role on its own devices."""
ROLES = ("learner", "rollout", "reward")
"""The roles that hold devices, in the order `--devices` and the plan list them."""


def parse_memory(value: Any) -> Any:
    """Bytes from "80GiB", "23GB", "512MiB" or a plain number of bytes; other values are returned as they
    are (the field's own validation then refuses them)."""
    if not isinstance(value, str):
        return value
    match = _MEMORY.match(value)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"expected bytes like '80GiB', '23GB' or '512MiB', got {value!r}")
    return int(float(match.group(1)) * UNITS[unit])


def format_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1, e.g. "15.2 GiB" (negative: "-1.0 GiB")."""
    size, sign = abs(float(n)), "-" if n < 0 else ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{sign}{size:.1f} {unit}" if unit != "B" else f"{sign}{size:.0f} B"
        size /= 1024
    return f"{sign}{size:.1f} TiB"


class ResourceModel(StrictModel):
    """Base of the resource sections: the run spec's strict types (no str -> int coercion but memory's)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class DeviceGroup(ResourceModel):
    """Devices of one kind and size that one role runs on."""

    kind: DeviceKind = "cuda"
    """Device kind: cuda (a GPU each) or cpu (a host's memory each)."""
    devices: int = Field(default=1, ge=1, le=MAX_DEVICES)
    """How many devices."""
    memory: int = Field(ge=1, le=MAX_MEMORY)
    """Memory of each device in bytes; "80GiB" and "23GB" are accepted too."""

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_units(cls, value: Any) -> Any:
        return parse_memory(value)


class RolloutDevices(DeviceGroup):
    """The rollout replicas: one device each (tensor parallelism is not planned)."""

    concurrency: int | None = Field(default=None, ge=1, le=MAX_CONCURRENCY)
    """Sequences one replica holds at once (their KV cache is planned); None:
    `rollout.max_in_flight_per_replica` groups of `rollout.sampling.n` samples."""


class ResourcesSpec(ResourceModel):
    """The declared placement: the devices of the learner (its FSDP world size is `learner.devices`), of
    the rollout replicas and of the reward model, and whether they share devices."""

    placement: Placement = "disaggregated"
    """colocated: the rollout replicas (one per learner device) and a reward model share the learner's
    devices, and the plan sums every role on each; disaggregated: each role on its own devices."""
    learner: DeviceGroup
    """The learner's devices: one FSDP rank each."""
    rollout: RolloutDevices | None = None
    """The rollout replicas (`devices` is the replica count); None: colocated, one replica per learner
    device; disaggregated, one replica on a device like the learner's."""
    reward: DeviceGroup | None = None
    """The reward model's devices (only runs scored by a `reward_model` scorer use them); None: on the
    learner's first device."""

    @model_validator(mode="after")
    def _colocated_shares_devices(self) -> ResourcesSpec:
        if self.placement != "colocated":
            return self
        for name in ("rollout", "reward"):
            group = getattr(self, name)
            if group is not None and (group.kind, group.memory) != (self.learner.kind, self.learner.memory):
                raise ValueError(
                    f"resources.{name}: colocated roles run on the learner's devices; give its kind and "
                    "memory or leave it out"
                )
        if self.rollout is not None and self.rollout.devices > self.learner.devices:
            raise ValueError("resources.rollout.devices: colocated replicas cannot outnumber learner devices")
        return self

    def rollout_group(self) -> RolloutDevices:
        """The rollout replicas' devices, defaults filled in."""
        if self.rollout is not None:
            return self.rollout
        count = self.learner.devices if self.placement == "colocated" else 1
        return RolloutDevices(kind=self.learner.kind, devices=count, memory=self.learner.memory)


def parse_devices(text: str) -> dict[str, Any]:
    """`--devices SPEC` (module docstring) as `ResourcesSpec` data; ValueError naming the bad item."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    groups: dict[str, dict[str, Any]] = {}
    for item in items:
        match = _DEVICE_ITEM.match(item)
        if match is None:
            raise ValueError(f"--devices: expected [ROLE=]COUNTxKIND:MEMORY like 2xcuda:80GiB, got {item!r}")
        role = match.group("role") or ""
        if role and role not in ROLES:
            raise ValueError(f"--devices: unknown role {role!r} in {item!r} (roles: {', '.join(ROLES)})")
        if role in groups:
            raise ValueError(f"--devices: {role or 'the colocated group'} is given twice")
        count, kind, memory = int(match.group("count")), match.group("kind"), match.group("memory")
        groups[role] = {"kind": kind, "devices": count, "memory": memory}
    if "" in groups:
        if len(groups) > 1:
            raise ValueError("--devices: one colocated group (COUNTxKIND:MEMORY) or ROLE= groups, not both")
        return {"placement": "colocated", "learner": groups[""]}
    if "learner" not in groups:
        raise ValueError("--devices: name the learner's devices (learner=COUNTxKIND:MEMORY)")
    return {"placement": "disaggregated", **groups}


def resources_from_devices(text: str, declared: ResourcesSpec | None) -> ResourcesSpec:
    """The placement of `--devices`, keeping the declared rollout concurrency (if any)."""
    data = parse_devices(text)
    concurrency = declared.rollout.concurrency if declared and declared.rollout else None
    if concurrency is not None:
        rollout = data.get("rollout") or {**data["learner"], "devices": 1}
        if data["placement"] == "colocated":
            rollout = {**data["learner"]}
        data["rollout"] = {**rollout, "concurrency": concurrency}
    return ResourcesSpec.model_validate(data)
