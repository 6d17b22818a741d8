"""The LoRA adapters a replica holds: one slot per adapter name, with its own version and admission.

No gRPC here (`replica.py` drives the slots). Invariants:
- At most `capacity` names are held (the engine's `max_adapters`): `reserve` of a new name when all are
  held raises ResourceExhausted naming `max_adapters`; no slot is ever evicted to make room.
- A slot serves (`serving`) only once its first version has loaded (`version is not None`); a slot whose
  first load failed is dropped again (`drop_if_unloaded`).
- Every request on an adapter is admitted by its slot and carries the slot's version at admission; the
  slot's updates close its admission and drain (or abort) its admitted requests first, so all samples of
  a request come from one adapter version. Other slots and the base are unaffected.
- Versions only increase per slot; a removed slot wakes everything waiting on it (they then find the
  name gone: NotFound).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

from rlfabric.rollout.engine import AdapterRef, AdaptersUnsupported
from rlfabric.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
"""An adapter name (a run id, typically): it also names the adapter's folder on the replica's disk."""


@dataclass
class AdapterSlot:
    """One adapter name: the version serving, its folder and the requests admitted on it."""

    name: str
    version: int | None = None
    path: str = ""
    in_flight: int = 0
    """Admitted prompts on this adapter not yet finished."""
    requests: set[str] = field(default_factory=set)
    admitting: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) whenever the version changes or the slot is removed."""

    def __post_init__(self) -> None:
        self.admitting.set()
        self.idle.set()

    def ref(self) -> AdapterRef:
        assert self.version is not None
        return AdapterRef(self.name, self.version, self.path)

    def set_version(self, version: int, path: str) -> None:
        self.version, self.path = version, path
        self.notify()

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def admit(self, request_id: str, count: int) -> None:
        self.in_flight += count
        self.requests.add(request_id)
        self.idle.clear()

    def release(self, request_id: str, count: int) -> None:
        self.in_flight -= count
        self.requests.discard(request_id)
        if self.in_flight == 0:
            self.idle.set()

    async def version_at_least(self, min_version: int, wait_s: float) -> None:
        """Waits until this slot serves `min_version` or newer (FailedPrecondition after `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while (self.version or 0) < min_version:
            changed = self.changed
            try:
                await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise FailedPrecondition(
                    f"min_policy_version: adapter {self.name!r} is at version {self.version} and version "
                    f"{min_version} did not arrive within {wait_s:g} s"
                ) from None


class AdapterSlots:
    """The slots of one replica, by name."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: dict[str, AdapterSlot] = {}
        self.changed = asyncio.Event()
        """Set (and replaced) whenever an adapter version is loaded or a slot removed."""

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def check_enabled(self) -> None:
        if self.capacity == 0:
            raise AdaptersUnsupported(
                "adapter: this replica was started without LoRA (engine.max_adapters is 0)"
            )

    def serving(self, name: str) -> AdapterSlot:
        """The slot of `name` once it serves; FailedPrecondition without LoRA, NotFound otherwise."""
        self.check_enabled()
        slot = self._slots.get(name)
        if slot is None or slot.version is None:
            raise NotFound(f"adapter: this replica holds no adapter {name!r}")
        return slot

    def holds(self, slot: AdapterSlot) -> bool:
        """Whether `slot` is still this replica's slot of its name (not removed)."""
        return self._slots.get(slot.name) is slot

    def check_room(self, name: str) -> None:
        """Raises unless adapter `name` could be loaded now: FailedPrecondition without LoRA,
        InvalidArgument for a bad name, ResourceExhausted for a new name when every slot is held."""
        self.check_enabled()
        if not ADAPTER_NAME.match(name):
            raise InvalidArgument(f"adapter: {name!r} is not a valid name (pattern {ADAPTER_NAME.pattern})")
        if name not in self._slots and len(self._slots) >= self.capacity:
            raise ResourceExhausted(
                f"adapter: all {self.capacity} adapter slots (engine.max_adapters) are held "
                f"({', '.join(sorted(self._slots))}); unload one (UnloadAdapter) before loading {name!r}"
            )

    def get(self, name: str) -> AdapterSlot | None:
        """The slot of `name`, serving or still loading its first version."""
        return self._slots.get(name)

    def reserve(self, name: str) -> AdapterSlot:
        """The slot of `name`, a new empty one if it has none (raises as `check_room`)."""
        self.check_room(name)
        return self._slots.setdefault(name, AdapterSlot(name))

    def drop_if_unloaded(self, slot: AdapterSlot) -> None:
        """Forget a reserved slot whose first version never loaded."""
        if slot.version is None and self.holds(slot):
            self.remove(slot)

    def remove(self, slot: AdapterSlot) -> None:
        del self._slots[slot.name]
        slot.notify()
        self.notify()
        slot.admitting.set()  # requests waiting to be admitted wake up and find the name gone

    def all(self) -> list[AdapterSlot]:
        """The slots that serve, by name."""
        return [s for _, s in sorted(self._slots.items()) if s.version is not None]
