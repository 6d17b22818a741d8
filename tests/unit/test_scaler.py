"""`rlfabric up`'s local replica scaler, over stand-in processes: patience, bounds, one change at a time."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rlfabric.local.scaler import LocalScaler, ScalePolicy


class StandIn:
    """What the scaler uses of a ServiceProcess."""

    def __init__(self, name: str, *, starts: threading.Event | None = None) -> None:
        self.name, self.alive, self.starts = name, False, starts

    def start(self, ready: str, timeout_s: float) -> None:
        self.alive = True
        if self.starts is not None:
            self.starts.wait(5)

    def running(self) -> bool:
        return self.alive

    def stop(self, grace_s: float = 15.0) -> None:
        self.alive = False


def scaler(minimum: int = 1, maximum: int = 3, *, running: int = 1, **kw: Any) -> LocalScaler:
    initial = [StandIn(f"rollout-{i}") for i in range(running)]
    for proc in initial:
        proc.alive = True
    launched: list[StandIn] = []

    def launch(i: int) -> Any:
        launched.append(StandIn(f"rollout-{i}", **kw))
        return launched[-1]

    policy = ScalePolicy(minimum, maximum, up_after_s=10.0, down_after_s=60.0)
    return LocalScaler(policy, launch, "ready", initial)  # type: ignore[arg-type]


def settle(s: LocalScaler) -> None:
    if s._starting is not None:
        s._starting.join(5)


def test_scales_out_only_after_the_signal_held_for_the_patience() -> None:
    s = scaler()
    assert s.observe(2, 0.0) is None
    assert s.observe(2, 9.0) is None
    event = s.observe(2, 10.0)
    assert event is not None and event.action == "out" and event.replica == "rollout-1"
    assert (event.running_before, event.desired) == (1, 2)
    settle(s)
    assert [p.name for p in s.replicas] == ["rollout-0", "rollout-1"]
    assert s.observe(2, 11.0) is None  # satisfied


def test_a_dip_resets_the_patience() -> None:
    s = scaler()
    s.observe(2, 0.0)
    s.observe(1, 5.0)
    s.observe(2, 6.0)
    assert s.observe(2, 15.0) is None
    assert s.observe(2, 16.0) is not None


def test_scales_in_slowly_and_stops_the_newest() -> None:
    s = scaler(running=3)
    newest = s.replicas[-1]
    s.observe(1, 0.0)
    assert s.observe(1, 59.0) is None
    event = s.observe(1, 60.0)
    assert event is not None and event.action == "in" and event.replica == newest.name
    assert len(s.replicas) == 2
    s._want = None
    s.observe(1, 61.0)
    assert s.observe(1, 121.0) is not None
    assert len(s.replicas) == 1
    assert s.observe(0, 500.0) is None and s.observe(0, 1000.0) is None  # never below the minimum


def test_never_above_the_maximum_and_one_start_at_a_time() -> None:
    release = threading.Event()
    s = scaler(maximum=2, starts=release)
    s.observe(9, 0.0)
    assert s.observe(9, 10.0) is not None
    assert s.observe(9, 30.0) is None  # still starting
    release.set()
    settle(s)
    s.observe(9, 40.0)
    assert s.observe(9, 100.0) is None  # at the maximum
    assert len(s.replicas) == 2


def test_a_crashed_replica_is_replaced_to_keep_the_minimum() -> None:
    s = scaler(minimum=2, running=2)
    s.replicas[0].alive = False  # type: ignore[attr-defined]
    s.observe(1, 0.0)
    event = s.observe(1, 10.0)
    assert event is not None and event.action == "out" and event.replica == "rollout-2"  # ids not reused


def test_policy_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min replicas"):
        ScalePolicy(0, 2)
    with pytest.raises(ValueError, match="min replicas"):
        ScalePolicy(3, 2)


class RestartingSupervisor:
    """A supervisor stand-in that is restarting every replica it watches."""

    def __init__(self) -> None:
        self.watched: list[Any] = []
        self.forgotten: list[Any] = []

    def alive(self, proc: Any) -> bool:
        return proc.running() or proc in self.watched

    def watch(self, proc: Any, ready: str) -> None:
        self.watched.append(proc)

    def forget(self, proc: Any) -> None:
        self.forgotten.append(proc)


def test_with_a_supervisor_a_dead_replica_is_restarted_not_replaced() -> None:
    """A replica the supervisor restarts still counts: the scaler starts no second one for it; one it
    adds is handed to the supervisor, and one it removes is taken back first."""
    s = scaler(minimum=1, maximum=2)
    supervisor = RestartingSupervisor()
    s.supervisor = supervisor  # type: ignore[assignment]
    supervisor.watched.append(s.replicas[0])
    s.replicas[0].alive = False  # died; being restarted
    for t in (0.0, 20.0, 40.0):
        assert s.observe(1, t) is None
    assert [p.name for p in s.replicas] == ["rollout-0"]
    assert s.observe(2, 50.0) is None and s.observe(2, 60.0) is not None
    settle(s)
    assert supervisor.watched[-1] is s.replicas[-1]
    assert s.observe(1, 61.0) is None and s.observe(1, 121.0) is not None
    assert supervisor.forgotten == [supervisor.watched[-1]]
