"""Local autoscaling for `rlfabric up`: rollout processes started and stopped by the run's desired-replica
signal (the number a cluster's KEDA or HPA reads as `rlfabric_coordinator_desired_replicas`).

    every poll   target = desired clamped to [minimum, maximum]
    scale out    target above the running count for `up_after_s`: start one replica in the background;
                 it takes work only once it holds a published version (the replica's own guarantee)
    scale in     target below it for `down_after_s`: SIGTERM the newest replica; it deregisters, and the
                 coordinator re-dispatches whatever it still had in flight, so nothing is lost

One change at a time: no decision while a replica is still starting. With a supervisor, a replica that
died is restarted by it under the same replica id, and counts as running meanwhile (the scaler does not
replace it); a replica the scaler added is supervised once ready, and forgotten before a scale-in stops
it. Scaling in waits longer than scaling
out, as the HPA's stabilisation window does, because a replica is slow to start and cheap to keep.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from rlfabric.local.procs import ServiceProcess, ServiceStartError
from rlfabric.local.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScalePolicy:
    """Bounds and patience of the local scaler."""

    minimum: int
    maximum: int
    up_after_s: float = 10.0
    """The target must stay above the running count this long before a replica is added."""
    down_after_s: float = 60.0
    """The target must stay below the running count this long before a replica is removed."""
    start_timeout_s: float = 600.0
    """A replica that prints no ready line in this time is stopped and counted as a failed start."""

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"need 1 <= min replicas <= max replicas (got {self.minimum}, {self.maximum})")


@dataclass
class ScaleEvent:
    """One decision, for the log and the run summary."""

    time: float
    action: str
    """"out" or "in"."""
    replica: str
    desired: int
    running_before: int


@dataclass
class LocalScaler:
    """Keeps the running rollout replicas between the policy's bounds, following the desired count.

    `launch(index)` returns a new, not yet started replica process (its ready line is `ready`); the
    processes it returns are also the caller's to stop at the end."""

    policy: ScalePolicy
    launch: Callable[[int], ServiceProcess]
    ready: str
    replicas: list[ServiceProcess]
    events: list[ScaleEvent] = field(default_factory=list)
    failed_starts: int = 0
    supervisor: Supervisor | None = None
    """Restarts replicas that die (see the module docstring); None: a dead replica is replaced."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards `replicas` against a hand-over (`replace`) from another thread."""
    _want: tuple[int, float] | None = None
    _starting: threading.Thread | None = None
    _next_index: int = 0

    def __post_init__(self) -> None:
        self._next_index = len(self.replicas)  # replica ids are never reused within one `up`

    def observe(self, desired: int | None, now: float) -> ScaleEvent | None:
        """Takes one reading of the desired count; returns the event if it scaled."""
        if self._starting is not None and self._starting.is_alive():
            return None
        with self._lock:
            self.replicas = [p for p in self.replicas if self.alive(p)]
        target = max(self.policy.minimum, min(self.policy.maximum, desired or 0))
        direction = (target > len(self.replicas)) - (target < len(self.replicas))
        if direction == 0:
            self._want = None
            return None
        if self._want is None or self._want[0] != direction:
            self._want = (direction, now)
            return None
        patience = self.policy.up_after_s if direction > 0 else self.policy.down_after_s
        if now - self._want[1] < patience:
            return None
        self._want = None
        before = len(self.replicas)
        proc = self.scale_out() if direction > 0 else self.scale_in()
        event = ScaleEvent(now, "out" if direction > 0 else "in", proc.name, target, before)
        self.events.append(event)
        return event

    def replace(self, old: ServiceProcess, new: ServiceProcess) -> None:
        """Counts `new` where `old` was (an eager replica handed over to its compiled twin)."""
        with self._lock:
            self.replicas = [new if p is old else p for p in self.replicas]

    def alive(self, proc: ServiceProcess) -> bool:
        """`proc` counts as running: it runs, or its supervisor is restarting it."""
        return self.supervisor.alive(proc) if self.supervisor is not None else proc.running()

    def scale_out(self) -> ServiceProcess:
        proc = self.launch(self._next_index)
        self._next_index += 1
        with self._lock:
            self.replicas.append(proc)
        self._starting = threading.Thread(target=self._start, args=(proc,), daemon=True)
        self._starting.start()
        return proc

    def _start(self, proc: ServiceProcess) -> None:
        try:
            proc.start(self.ready, timeout_s=self.policy.start_timeout_s)
        except ServiceStartError:
            log.warning("scaled-out replica %s did not start", proc.name, exc_info=True)
            self.failed_starts += 1
            proc.stop(grace_s=10)
            return
        if self.supervisor is not None:
            self.supervisor.watch(proc, self.ready)

    def scale_in(self) -> ServiceProcess:
        with self._lock:
            proc = self.replicas.pop()
        if self.supervisor is not None:
            self.supervisor.forget(proc)
        threading.Thread(target=proc.stop, kwargs={"grace_s": 30}, daemon=True).start()
        return proc
