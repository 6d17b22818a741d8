"""Locust load test of the coordinator's REST API (loopback only, bounded in time).

    locust -f loadtest/coordinator_locustfile.py --headless -u 20 -r 20 -t 30s \\
        -H http://127.0.0.1:8000 --token "$TOKEN" --only-summary

Each user, with no think time, mixes what dashboards and the CLI do: status of a run (weight 10), the
run list (3), a page of its metrics (3), the health check (2), a submit of a new run (1), and bad
requests that must be refused with the right code (1 each: no token -> 401, malformed body -> 422,
oversized body -> 413). A refusal with the expected code is a success; any other code is a failure.
Submitted runs point at a dataset that does not exist, so they fail at once and start no work: the load
is the API's and Redis's, not a training run's. At the end the file prints requests/s, p50/p99 and the
error rate for the whole run.

The target must be a loopback address, and the run stops after `--max-seconds` (default 300) even
without `-t`. Flags (or environment variables): `--token`/`COORDINATOR_TOKEN`,
`--max-seconds`/`COORDINATOR_MAX_SECONDS`.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import urllib.parse
from typing import Any

import gevent
from locust import HttpUser, constant, events, task
from locust.env import Environment

SPEC = {
    "model": {"path": "unused-model"},
    "dataset": {"path": "no-such-dataset.jsonl", "reference_field": None},
    "reward": {"scorer": "exact_match"},
}
_names = itertools.count()


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("coordinator")
    group.add_argument("--token", default="", env_var="COORDINATOR_TOKEN", help="the coordinator's api.token")
    group.add_argument("--max-seconds", type=float, default=300.0, env_var="COORDINATOR_MAX_SECONDS")


@events.test_start.add_listener
def on_start(environment: Environment, **_: Any) -> None:
    host = urllib.parse.urlsplit(environment.host or "").hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"refusing to load {host!r}: loopback targets only")
    limit = environment.parsed_options.max_seconds if environment.parsed_options else 300.0
    if environment.runner is not None:
        gevent.spawn_later(limit, environment.runner.quit)


class CoordinatorUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        token = self.environment.parsed_options.token if self.environment.parsed_options else ""
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.run_id = self.submit()

    def submit(self) -> str:
        name = f"load-{os.getpid()}-{next(_names)}"
        with self.client.post(
            "/v1/runs",
            json={**SPEC, "name": name},
            headers=self.auth,
            name="POST /v1/runs",
            catch_response=True,
        ) as response:
            if response.status_code != 201:
                response.failure(f"submit: {response.status_code} {response.text[:200]}")
        return name

    def expect(self, method: str, path: str, code: int, name: str, **kwargs: Any) -> None:
        with self.client.request(method, path, name=name, catch_response=True, **kwargs) as response:
            if response.status_code == code:
                response.success()
            else:
                response.failure(f"expected {code}, got {response.status_code}")

    @task(10)
    def status(self) -> None:
        self.expect("GET", f"/v1/runs/{self.run_id}", 200, "GET /v1/runs/{id}", headers=self.auth)

    @task(3)
    def list_runs(self) -> None:
        self.expect("GET", "/v1/runs?limit=20", 200, "GET /v1/runs", headers=self.auth)

    @task(3)
    def metrics(self) -> None:
        self.expect(
            "GET", f"/v1/runs/{self.run_id}/metrics", 200, "GET /v1/runs/{id}/metrics", headers=self.auth
        )

    @task(2)
    def health(self) -> None:
        self.expect("GET", "/healthz", 200, "GET /healthz")

    @task(1)
    def submit_task(self) -> None:
        self.submit()

    @task(1)
    def no_token(self) -> None:
        if self.auth:
            self.expect("GET", "/v1/runs", 401, "401 no token")

    @task(1)
    def malformed(self) -> None:
        self.expect("POST", "/v1/runs", 422, "422 malformed", data=b"{nope", headers=self.auth)

    @task(1)
    def oversized(self) -> None:
        body = json.dumps({**SPEC, "name": "x" * (2 << 20)})
        self.expect("POST", "/v1/runs", 413, "413 oversized", data=body, headers=self.auth)


@events.quitting.add_listener
def summary(environment: Environment, **_: Any) -> None:
    total = environment.stats.total
    if not total.num_requests:
        return
    # A task that raised made no request locust could count: it is an error of the run all the same.
    raised = sum(e["count"] for e in environment.runner.exceptions.values()) if environment.runner else 0
    errors = total.num_failures + raised
    print(
        f"coordinator loadtest: {total.num_requests} requests, {total.total_rps:.1f} req/s, "
        f"p50 {total.get_response_time_percentile(0.5):.0f} ms, "
        f"p99 {total.get_response_time_percentile(0.99):.0f} ms, "
        f"errors {errors} ({100 * errors / (total.num_requests + raised):.2f} %: "
        f"{total.num_failures} failed requests, {raised} tasks raised)",
        flush=True,
    )
