"""Locust load test of the reward service's `Score` RPC (gRPC, batches of 64 items by default).

    RLFABRIC_REWARD_TOKEN=... locust -f loadtest/reward_locustfile.py --headless -u 20 -r 20 -t 30s \\
        -H 127.0.0.1:50052 --scorer exact_match --batch-size 64

Each simulated user keeps one Score call in flight, back to back (no think time), cycling over
pre-built requests of distinct items, so the load is the service's and not the client's conversion.
Every call fires one locust request event named `Score/<scorer>` with its response time; a gRPC error
or an item whose status is not OK is a failure. `response_length` is the number of items scored, so
locust's "Average size" column reads items per call. At the end the file prints items/s and the
p50/p99 latency per call.

Flags (or environment variables): `-H`/`LOCUST_HOST` the target host:port (loopback by default),
`--scorer`/`REWARD_SCORER` (exact_match or math_verify), `--batch-size`/`REWARD_BATCH_SIZE`,
`--distinct-items`/`REWARD_DISTINCT_ITEMS`, `--call-timeout`/`REWARD_CALL_TIMEOUT`, `--token`/
`RLFABRIC_REWARD_TOKEN` the service's bearer token (sent on every call, as the coordinator does).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import time
from fractions import Fraction
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from rlfabric.reward.client import build_request, to_spec
from rlfabric.v1 import common_pb2, reward_pb2, reward_pb2_grpc

# Before any channel exists (importing grpc is fine): gRPC's core must yield to gevent's hub, or a call
# blocks every simulated user of this process.
grpc_gevent.init_gevent()

SCORERS = ("exact_match", "math_verify")


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    """This file's own flags; locust shows them under `--help`."""
    group = parser.add_argument_group("reward service")
    group.add_argument("--scorer", choices=SCORERS, default="exact_match", env_var="REWARD_SCORER")
    group.add_argument("--batch-size", type=int, default=64, env_var="REWARD_BATCH_SIZE")
    group.add_argument("--distinct-items", type=int, default=2048, env_var="REWARD_DISTINCT_ITEMS")
    group.add_argument("--call-timeout", type=float, default=60.0, env_var="REWARD_CALL_TIMEOUT")
    group.add_argument("--token", default="", env_var="RLFABRIC_REWARD_TOKEN", help="the service's token")


def make_items(scorer: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` distinct items for `scorer`, about a quarter of them wrong."""
    rng = random.Random(seed)
    make = math_item if scorer == "math_verify" else exact_item
    return [make(i, rng) for i in range(n)]


def exact_item(i: int, rng: random.Random) -> dict[str, str]:
    reference = f"{rng.choice(['paris', 'oxygen', 'euler', '42'])} {i}"
    completion = reference if rng.random() > 0.25 else f"wrong {i}"
    return {
        "id": f"e{i}",
        "prompt": f"Question {i}?",
        "completion": f" {completion} ",
        "reference": reference,
    }


def math_item(i: int, rng: random.Random) -> dict[str, str]:
    value = Fraction(rng.randint(1, 500) + i, rng.randint(2, 97))
    shown = value if rng.random() > 0.25 else value + 1
    completion = f"Let's simplify step by step. The final answer is $\\boxed{{{shown}}}$."
    reference = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    return {"id": f"m{i}", "prompt": f"Simplify {value.numerator * 3}/{value.denominator * 3}.",
            "completion": completion, "reference": reference}  # fmt: skip


@functools.cache
def make_requests(scorer: str, batch_size: int, distinct: int) -> list[reward_pb2.ScoreRequest]:
    """Pre-built requests of `batch_size` items each, covering `distinct` items; built once per process
    and shared by its users (read-only), so spawning users costs no conversion."""
    items = make_items(scorer, max(distinct, batch_size))
    spec = to_spec(scorer)
    return [build_request(items[i : i + batch_size], spec, None) for i in range(0, len(items), batch_size)]


class RewardUser(User):
    """One stream of back-to-back Score calls on its own channel and connection (as separate trainers
    would be; without a local subchannel pool gRPC would share one connection between every user, and
    a service with several server processes would see a single one of them loaded)."""

    host = os.environ.get("LOCUST_HOST", "127.0.0.1:50052")
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.scorer = options.scorer
        self.timeout_s = options.call_timeout
        requests = make_requests(self.scorer, options.batch_size, options.distinct_items)
        offset = random.randrange(len(requests))
        self.requests = itertools.cycle(requests[offset:] + requests[:offset])  # users start apart
        self.channel = grpc.insecure_channel(self.host, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {options.token}"),) if options.token else ()

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def score(self) -> None:
        """One Score call, reported to locust with its latency, the items scored and any failure."""
        request = next(self.requests)
        start = time.perf_counter()
        items, exception = 0, None
        try:
            response = self.stub.Score(request, timeout=self.timeout_s, metadata=self.metadata)
            items = len(response.results)
            exception = check_statuses(response)
        except grpc.RpcError as exc:
            exception = exc
        self.environment.events.request.fire(
            request_type="grpc",
            name=f"Score/{self.scorer}",
            response_time=(time.perf_counter() - start) * 1000,
            response_length=items,
            exception=exception,
            context={},
        )


class ItemsNotScored(Exception):
    """Some items of a call came back with a status other than OK (a timeout or a scorer error)."""


def check_statuses(response: reward_pb2.ScoreResponse) -> ItemsNotScored | None:
    bad = sum(1 for r in response.results if r.reward.status != common_pb2.REWARD_STATUS_OK)
    return ItemsNotScored(f"{bad} of {len(response.results)} items not OK") if bad else None


@events.quitting.add_listener
def report(environment: Environment, **_: Any) -> None:
    """Prints items/s and p50/p99 per call for the whole run (on the process that holds the stats)."""
    if isinstance(environment.runner, WorkerRunner):
        return
    total = environment.stats.total
    seconds = max(total.last_request_timestamp - total.start_time, 1e-9) if total.num_requests else 0.0
    items_per_s = total.total_content_length / seconds if seconds else 0.0
    print(
        f"reward loadtest: {total.num_requests} calls, {total.num_failures} failures, "
        f"{total.total_content_length} items in {seconds:.1f} s = {items_per_s:,.0f} items/s, "
        f"{total.total_rps:,.1f} calls/s, p50 {total.get_response_time_percentile(0.5):.0f} ms, "
        f"p99 {total.get_response_time_percentile(0.99):.0f} ms",
        flush=True,
    )
