"""The autoscaling signal of a run: how busy its rollout replicas are, what waits for them, and how many
replicas the run wants.

The pipeline tells a `BusyMeter` every time a replica's in-flight count changes; every few seconds
`scaling_signal` turns the meter and the pipeline's queue into one `ScalingSignal`:

    busy_fraction   mean over the serving replicas of the time share (last `window_s`) with work in flight
    backlog_groups  groups the lag bound admitted that wait for a free replica slot (not yet dispatched)
    desired         the replica count the run wants, by the rule of Kubernetes' HPA on the busy fraction,
                    raised to hold what is admitted and capped by what the lag bound can ever keep busy

Whoever scales clamps `desired` between its own minimum and maximum: `rlfabric up --min-replicas
--max-replicas` locally, KEDA's minReplicaCount / maxReplicaCount on a cluster (the coordinator exports
the same numbers as Prometheus gauges). When generation is the bottleneck every replica stays busy and
the run asks for more; when the learner is, the lag bound idles the replicas and the run asks for fewer.

The runs of a shared rollout fleet (`rollout.fleet`) also add up to the fleet's signal: the same fields
over the fleet's replicas and the sum of its runs' demand (`fleet.FleetScheduler`), exported as the
`rlfabric_coordinator_fleet_*` gauges labelled `fleet`.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis
from prometheus_client import Gauge

from rlfabric.contracts import keys
from rlfabric.contracts.streams import group_info
from rlfabric.coordinator.config import ScalingConfig


@dataclass
class ReplicaBusy:
    """One replica's busy intervals: the closed ones inside the window, the open one, and run totals."""

    first_seen: float
    busy_since: float | None = None
    closed: deque[tuple[float, float]] = field(default_factory=deque)
    busy_total_s: float = 0.0

    def busy_in(self, start: float, now: float) -> float:
        """Seconds of [start, now] this replica had work in flight."""
        intervals = [*self.closed, *([(self.busy_since, now)] if self.busy_since is not None else [])]
        return sum(max(0.0, min(end, now) - max(begin, start)) for begin, end in intervals)


class BusyMeter:
    """Time-exact busy fractions of replicas, fed with every in-flight count change."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.replicas: dict[str, ReplicaBusy] = {}
        self.first_dispatch: float | None = None

    def seen(self, address: str, now: float) -> None:
        """A replica joined the pool (idle until work reaches it)."""
        self.replicas.setdefault(address, ReplicaBusy(first_seen=now))

    def gone(self, address: str, now: float) -> None:
        self.update(address, 0, now)
        self.replicas.pop(address, None)

    def update(self, address: str, in_flight: int, now: float) -> None:
        """The replica's in-flight count became `in_flight`."""
        replica = self.replicas.setdefault(address, ReplicaBusy(first_seen=now))
        if in_flight > 0 and replica.busy_since is None:
            replica.busy_since = now
            self.first_dispatch = self.first_dispatch if self.first_dispatch is not None else now
        elif in_flight == 0 and replica.busy_since is not None:
            replica.closed.append((replica.busy_since, now))
            replica.busy_total_s += now - replica.busy_since
            replica.busy_since = None
        while replica.closed and replica.closed[0][1] < now - self.window_s:
            replica.closed.popleft()

    def busy_fraction(self, now: float) -> float:
        """Mean over current replicas of the busy share of the last window (or of their life if shorter)."""
        shares = []
        for replica in self.replicas.values():
            start = max(now - self.window_s, replica.first_seen)
            if now > start:
                shares.append(replica.busy_in(start, now) / (now - start))
        return sum(shares) / len(shares) if shares else 0.0

    def run_busy_fraction(self, now: float) -> float:
        """Busy share of every current replica since the run's first dispatch (or since it joined)."""
        if self.first_dispatch is None:
            return 0.0
        shares = []
        for replica in self.replicas.values():
            start = max(self.first_dispatch, replica.first_seen)
            open_s = now - replica.busy_since if replica.busy_since is not None else 0.0
            if now > start:
                shares.append(min(1.0, (replica.busy_total_s + open_s) / (now - start)))
        return sum(shares) / len(shares) if shares else 0.0


@dataclass(frozen=True)
class ScalingSignal:
    """What the run exports for autoscalers (Prometheus gauges, `GET /v1/runs/{id}` field `scaling`)."""

    replicas: int
    """Serving replicas the pipeline sees now."""
    busy_fraction: float
    """Mean busy share of those replicas over the window."""
    run_busy_fraction: float
    """Mean busy share since the run's first dispatch."""
    in_flight_groups: int
    """Groups dispatched to a replica and not yet returned."""
    backlog_groups: int
    """Groups admitted by the lag bound, waiting for a free replica slot."""
    desired_replicas: int
    """The replica count the run wants (unclamped: at least 1 while the run has work)."""

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def desired_replicas(
    replicas: int, busy: float, demand: int, per_replica: int, admit_bound: int, config: ScalingConfig
) -> int:
    """The HPA rule on the busy fraction, at least what holds `demand` (groups admitted: in flight plus
    waiting) and at most `admit_bound` (more replicas than groups the lag bound admits can never be busy).
    With no replica at all, one is wanted as soon as anything is admitted."""
    if replicas == 0:
        return 1 if demand else 0
    ratio = busy / config.target_busy_fraction
    by_busy = replicas if abs(ratio - 1.0) <= config.tolerance else math.ceil(replicas * ratio)
    by_demand = math.ceil(demand / per_replica)
    return max(1, min(max(by_busy, by_demand), max(admit_bound, 1)))


def scaling_signal(
    meter: BusyMeter,
    now: float,
    *,
    in_flight: int,
    backlog: int,
    per_replica: int,
    admit_bound: int,
    config: ScalingConfig,
) -> ScalingSignal:
    """The signal from the meter and the pipeline's queue at time `now`."""
    replicas = len(meter.replicas)
    busy = meter.busy_fraction(now)
    desired = desired_replicas(replicas, busy, in_flight + backlog, per_replica, admit_bound, config)
    return ScalingSignal(
        replicas=replicas,
        busy_fraction=round(busy, 4),
        run_busy_fraction=round(meter.run_busy_fraction(now), 4),
        in_flight_groups=in_flight,
        backlog_groups=backlog,
        desired_replicas=desired,
    )


_BACKLOG = Gauge(
    "rlfabric_coordinator_backlog_groups",
    "Groups admitted by the policy-lag bound and waiting for a free rollout replica slot",
    ["run_id"],
)
_BUSY = Gauge(
    "rlfabric_coordinator_replica_busy_ratio",
    "Mean share (0-1) of the recent window the run's serving replicas had work in flight",
    ["run_id"],
)
_DESIRED = Gauge(
    "rlfabric_coordinator_desired_replicas",
    "Rollout replicas the run wants (the autoscaling target; clamp it between your min and max)",
    ["run_id"],
)
_REPLICAS = Gauge("rlfabric_coordinator_serving_replicas", "Serving replicas the run sees", ["run_id"])
_IN_FLIGHT = Gauge("rlfabric_coordinator_in_flight_groups", "Groups dispatched, not yet returned", ["run_id"])


_QUEUE = Gauge(
    "rlfabric_coordinator_learner_queue_groups",
    "Scored groups in the run's Redis stream: not yet delivered to the learner, or delivered and not yet "
    "trimmed",
    ["run_id"],
)
_QUEUE_LAG = Gauge(
    "rlfabric_coordinator_learner_queue_lag_groups",
    "Scored groups in the run's Redis stream not yet delivered to the learner (the consumer group's lag)",
    ["run_id"],
)
_QUEUE_PENDING = Gauge(
    "rlfabric_coordinator_learner_queue_pending_groups",
    "Scored groups delivered to the learner and not yet acknowledged (trained or dropped)",
    ["run_id"],
)
_GAUGES = (_BACKLOG, _BUSY, _DESIRED, _REPLICAS, _IN_FLIGHT, _QUEUE, _QUEUE_LAG, _QUEUE_PENDING)


@dataclass(frozen=True)
class LearnerQueue:
    """The depth of a run's groups stream (`keys.groups`), the queue between the coordinator and the
    learner: `undelivered + pending <= entries` (the rest are acknowledged and wait for the next trim)."""

    entries: int
    """XLEN of the stream."""
    undelivered: int
    """The learner consumer group's lag (entries never delivered); counted to `entries` when Redis cannot
    tell (nil lag after a deletion)."""
    pending: int
    """Entries delivered to the learner and not yet acknowledged."""


async def learner_queue(redis: aioredis.Redis, run_id: str) -> LearnerQueue:
    """The stream's depth now (all 0 before the first group is enqueued)."""
    entries = int(await redis.xlen(keys.groups(run_id)))
    if entries == 0:  # nothing pending either: only acknowledged entries are ever trimmed
        return LearnerQueue(0, 0, 0)
    info = await group_info(redis, run_id)
    lag = info.get("lag")
    return LearnerQueue(entries, entries if lag is None else int(lag), int(info.get("pending") or 0))


def export_queue_gauges(run_id: str, queue: LearnerQueue) -> None:
    _QUEUE.labels(run_id).set(queue.entries)
    _QUEUE_LAG.labels(run_id).set(queue.undelivered)
    _QUEUE_PENDING.labels(run_id).set(queue.pending)


def export_scaling_gauges(run_id: str, signal: ScalingSignal) -> None:
    _BACKLOG.labels(run_id).set(signal.backlog_groups)
    _BUSY.labels(run_id).set(signal.busy_fraction)
    _DESIRED.labels(run_id).set(signal.desired_replicas)
    _REPLICAS.labels(run_id).set(signal.replicas)
    _IN_FLIGHT.labels(run_id).set(signal.in_flight_groups)


_FLEET_BACKLOG = Gauge(
    "rlfabric_coordinator_fleet_backlog_groups",
    "Groups of the fleet's runs admitted by their policy-lag bounds and waiting for a free slot on the fleet",
    ["fleet"],
)
_FLEET_BUSY = Gauge(
    "rlfabric_coordinator_fleet_replica_busy_ratio",
    "Mean share (0-1) of the recent window the fleet's serving replicas had work in flight (any run's)",
    ["fleet"],
)
_FLEET_DESIRED = Gauge(
    "rlfabric_coordinator_fleet_desired_replicas",
    "Rollout replicas the fleet's runs want together (the fleet's autoscaling target; clamp it)",
    ["fleet"],
)
_FLEET_REPLICAS = Gauge(
    "rlfabric_coordinator_fleet_serving_replicas",
    "Serving replicas of the fleet the coordinator sees",
    ["fleet"],
)
_FLEET_IN_FLIGHT = Gauge(
    "rlfabric_coordinator_fleet_in_flight_groups",
    "Groups of the fleet's runs dispatched to its replicas, not yet returned",
    ["fleet"],
)
_FLEET_GAUGES = (_FLEET_BACKLOG, _FLEET_BUSY, _FLEET_DESIRED, _FLEET_REPLICAS, _FLEET_IN_FLIGHT)


def export_fleet_gauges(fleet: str, signal: ScalingSignal) -> None:
    """A shared fleet's signal (summed over its runs), as the run gauges but labelled `fleet`."""
    values = (
        signal.backlog_groups,
        signal.busy_fraction,
        signal.desired_replicas,
        signal.replicas,
        signal.in_flight_groups,
    )
    for gauge, value in zip(_FLEET_GAUGES, values, strict=True):
        gauge.labels(fleet).set(value)


def clear_fleet_gauges(fleet: str) -> None:
    """A fleet without runs on it asks for nothing: its series disappear from /metrics."""
    for gauge in _FLEET_GAUGES:
        with contextlib.suppress(KeyError):
            gauge.remove(fleet)


def clear_scaling_gauges(run_id: str) -> None:
    """A finished run stops asking for replicas: its series disappear from /metrics."""
    for gauge in _GAUGES:
        with contextlib.suppress(KeyError):
            gauge.remove(run_id)
