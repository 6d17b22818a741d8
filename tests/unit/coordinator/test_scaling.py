"""The autoscaling signal: exact busy fractions from load changes, and the desired-replica rule."""

from __future__ import annotations

import pytest

from rlfabric.coordinator.config import ScalingConfig
from rlfabric.coordinator.scaling import BusyMeter, desired_replicas, scaling_signal

RULE = ScalingConfig(target_busy_fraction=0.8, tolerance=0.1, window_s=10.0)


def test_busy_fraction_integrates_time_with_work_in_flight() -> None:
    meter = BusyMeter(window_s=10.0)
    meter.seen("a", 0.0)
    meter.update("a", 1, 2.0)
    meter.update("a", 2, 3.0)  # more work: still one busy interval
    meter.update("a", 0, 6.0)
    assert meter.busy_fraction(10.0) == pytest.approx(4 / 10)
    meter.update("a", 1, 10.0)
    assert meter.busy_fraction(15.0) == pytest.approx((1 + 5) / 10)  # [5, 15]: 5..6 and 10..15


def test_window_forgets_old_work_but_the_run_fraction_does_not() -> None:
    meter = BusyMeter(window_s=10.0)
    meter.seen("a", 0.0)
    meter.update("a", 1, 0.0)
    meter.update("a", 0, 10.0)
    assert meter.busy_fraction(30.0) == 0.0
    assert meter.run_busy_fraction(30.0) == pytest.approx(10 / 30)


def test_a_replica_counts_from_when_it_joined_and_the_mean_is_over_replicas() -> None:
    meter = BusyMeter(window_s=100.0)
    meter.seen("a", 0.0)
    meter.update("a", 1, 0.0)
    meter.seen("b", 50.0)
    meter.update("b", 1, 75.0)
    assert meter.busy_fraction(100.0) == pytest.approx((1.0 + 0.5) / 2)
    meter.gone("b", 100.0)
    assert meter.busy_fraction(100.0) == pytest.approx(1.0)


def test_idle_meter() -> None:
    meter = BusyMeter(window_s=10.0)
    assert meter.busy_fraction(5.0) == 0.0
    assert meter.run_busy_fraction(5.0) == 0.0


@pytest.mark.parametrize(
    ("replicas", "busy", "demand", "bound", "want"),
    [
        (1, 1.0, 8, 16, 2),  # saturated: ceil(1 * 1.0 / 0.8)
        (2, 1.0, 16, 16, 3),
        (3, 0.8, 16, 16, 3),  # on target
        (3, 0.75, 16, 16, 3),  # within tolerance: no change
        (4, 0.3, 8, 16, 2),  # ceil(4 * 0.3 / 0.8) = 2
        (4, 0.0, 0, 16, 1),  # idle: never below one while the run lives
        (1, 1.0, 8, 1, 1),  # more replicas than admitted groups could never be busy
        (1, 0.5, 130, 200, 3),  # what is admitted needs ceil(130 / 64) slots' worth of replicas
        (0, 0.0, 4, 16, 1),  # nothing serving but work admitted
        (0, 0.0, 0, 16, 0),
    ],
)
def test_desired_replicas(replicas: int, busy: float, demand: int, bound: int, want: int) -> None:
    assert desired_replicas(replicas, busy, demand, 64, bound, RULE) == want


def test_signal_reports_queue_and_meter() -> None:
    meter = BusyMeter(window_s=10.0)
    meter.seen("a", 0.0)
    meter.update("a", 3, 0.0)
    signal = scaling_signal(meter, 10.0, in_flight=3, backlog=5, per_replica=4, admit_bound=16, config=RULE)
    assert signal.replicas == 1
    assert signal.busy_fraction == 1.0
    assert signal.backlog_groups == 5
    assert signal.desired_replicas == 2  # both rules agree: saturated, and 8 groups need 2 x 4 slots
