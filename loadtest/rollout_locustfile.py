"""Locust load test of a rollout replica's streaming `Generate` RPC (gRPC, loopback only, bounded in time).

    RLFABRIC_ROLLOUT_TOKEN=... locust -f loadtest/rollout_locustfile.py --headless -u 16 -r 16 -t 60s \\
        -H 127.0.0.1:50051 --n 8 --max-tokens 64 --only-summary

Each simulated user keeps one Generate call in flight, back to back (no think time), on its own channel
(as the coordinators of several runs would): one prompt from a pool of distinct ones, `--n` samples of up
to `--max-tokens` tokens. Every call fires two locust request events: `Generate/first sample` (the time
to the first streamed sample) and `Generate/all samples` (the whole call; its `response_length` is the
tokens generated, so locust's "Average size" column reads tokens per call). A call the replica refuses
with RESOURCE_EXHAUSTED (more prompts in flight than its `max_in_flight`) is load shedding, which is the
replica doing its job: it is reported as `Generate/shed (RESOURCE_EXHAUSTED)`, not as a failure, and the
user waits `--shed-backoff` seconds before trying again, as the coordinator does. Any other error, a
stream with fewer than `--n` samples, or a sample without tokens is a failure. At the end the file prints
samples/s, tokens/s, the first-sample and whole-call p50/p99, the calls shed and the failures.

The target must be a loopback address, and the run stops after `--max-seconds` (default 300) even
without `-t`. Flags (or environment variables): `-H`/`LOCUST_HOST`, `--n`/`ROLLOUT_N` (8),
`--max-tokens`/`ROLLOUT_MAX_TOKENS` (64), `--temperature`/`ROLLOUT_TEMPERATURE` (1.0),
`--distinct-prompts`/`ROLLOUT_DISTINCT_PROMPTS` (256), `--call-timeout`/`ROLLOUT_CALL_TIMEOUT` (300 s),
`--shed-backoff`/`ROLLOUT_SHED_BACKOFF` (0.1 s), `--token`/`RLFABRIC_ROLLOUT_TOKEN` the replica's
`client_token` (sent on every call, as the coordinator does), `--max-seconds`/`ROLLOUT_MAX_SECONDS`.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import time
from typing import Any

import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from rlfabric.contracts import wire
from rlfabric.runspec import SamplingSpec
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc

# Before any channel exists: gRPC's core must yield to gevent's hub, or a call blocks every simulated user.
grpc_gevent.init_gevent()

WORDS = ("river", "stone", "number", "seven", "window", "green", "answer", "quiet", "letter", "north")
_calls = itertools.count()


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    """This file's own flags; locust shows them under `--help`."""
    group = parser.add_argument_group("rollout replica")
    group.add_argument("--n", type=int, default=8, env_var="ROLLOUT_N", help="samples per prompt")
    group.add_argument("--max-tokens", type=int, default=64, env_var="ROLLOUT_MAX_TOKENS")
    group.add_argument("--temperature", type=float, default=1.0, env_var="ROLLOUT_TEMPERATURE")
    group.add_argument("--distinct-prompts", type=int, default=256, env_var="ROLLOUT_DISTINCT_PROMPTS")
    group.add_argument("--call-timeout", type=float, default=300.0, env_var="ROLLOUT_CALL_TIMEOUT")
    group.add_argument("--shed-backoff", type=float, default=0.1, env_var="ROLLOUT_SHED_BACKOFF",
                       help="seconds a user waits after RESOURCE_EXHAUSTED")  # fmt: skip
    group.add_argument("--token", default="", env_var="RLFABRIC_ROLLOUT_TOKEN", help="the client_token")
    group.add_argument("--max-seconds", type=float, default=300.0, env_var="ROLLOUT_MAX_SECONDS")


@events.test_start.add_listener
def on_start(environment: Environment, **_: Any) -> None:
    """Refuses a target off loopback and bounds the run to `--max-seconds`."""
    host = (environment.host or RolloutUser.host).rsplit(":", 1)[0].strip("[]")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"rollout loadtest: {host} is not a loopback address")
    runner = environment.runner
    if runner is not None and not isinstance(runner, WorkerRunner):
        gevent.spawn_later(environment.parsed_options.max_seconds, runner.quit)


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct short prompts."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for i in range(n)]


class TooFewSamples(Exception):
    """The stream ended with fewer samples than asked for, or a sample came without tokens."""


class RolloutUser(User):
    """One stream of back-to-back Generate calls on its own channel and connection."""

    host = os.environ.get("LOCUST_HOST", "127.0.0.1:50051")
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.options = options
        prompts = make_prompts(max(options.distinct_prompts, 1))
        offset = random.randrange(len(prompts))
        self.prompts = itertools.cycle(prompts[offset:] + prompts[:offset])  # users start apart
        spec = SamplingSpec(n=options.n, temperature=options.temperature, max_tokens=options.max_tokens)
        self.sampling = wire.sampling_to_proto(spec)
        self.channel = grpc.insecure_channel(self.host, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {options.token}"),) if options.token else ()

    def on_stop(self) -> None:
        self.channel.close()

    def fire(self, name: str, seconds: float, length: int = 0, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=seconds * 1000, response_length=length,
            exception=exception, context={},
        )  # fmt: skip

    @task
    def generate(self) -> None:
        """One Generate call: its first sample, the whole call, or its shedding, reported to locust."""
        call = next(_calls)
        text = wire.prompt_to_proto(next(self.prompts))
        prompt = rollout_pb2.GeneratePrompt(prompt_id=f"p{call}", prompt=text)
        request = rollout_pb2.GenerateRequest(
            request_id=f"loadtest-{os.getpid()}-{call}", prompts=[prompt], sampling=self.sampling
        )
        start = time.perf_counter()
        samples, tokens, first = 0, 0, None
        try:
            for sample in self.stub.Generate(
                request, timeout=self.options.call_timeout, metadata=self.metadata
            ):
                if first is None:
                    first = time.perf_counter() - start
                    self.fire("Generate/first sample", first)
                samples += 1
                tokens += len(sample.token_ids)
                if not sample.token_ids:
                    raise TooFewSamples(f"sample {sample.sample_index} has no tokens")
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                self.fire("Generate/shed (RESOURCE_EXHAUSTED)", time.perf_counter() - start)
                gevent.sleep(self.options.shed_backoff)
                return
            self.fire("Generate/all samples", time.perf_counter() - start, tokens, exc)
            return
        except TooFewSamples as exc:
            self.fire("Generate/all samples", time.perf_counter() - start, tokens, exc)
            return
        short = TooFewSamples(f"{samples} of {self.options.n} samples") if samples < self.options.n else None
        self.fire("Generate/all samples", time.perf_counter() - start, tokens, short)


@events.quitting.add_listener
def report(environment: Environment, **_: Any) -> None:
    """Prints samples/s, tokens/s, first-sample and whole-call p50/p99, sheds and failures for the run."""
    if isinstance(environment.runner, WorkerRunner):
        return
    stats, n = environment.stats, environment.parsed_options.n
    calls = stats.get("Generate/all samples", "grpc")
    first = stats.get("Generate/first sample", "grpc")
    shed = stats.get("Generate/shed (RESOURCE_EXHAUSTED)", "grpc")
    total = stats.total
    seconds = max(total.last_request_timestamp - total.start_time, 1e-9) if total.num_requests else 0.0
    done = calls.num_requests - calls.num_failures
    per_s = 1 / seconds if seconds else 0.0
    tokens = calls.total_content_length
    print(
        f"rollout loadtest: {calls.num_requests} calls, {calls.num_failures} failures, {shed.num_requests} "
        f"shed; {done * n} samples, {tokens} tokens in {seconds:.1f} s = {done * n * per_s:,.1f} samples/s, "
        f"{tokens * per_s:,.0f} tokens/s; first sample p50 {percentile(first, 0.5)} ms, "
        f"p99 {percentile(first, 0.99)} ms; call p50 {percentile(calls, 0.5)} ms, "
        f"p99 {percentile(calls, 0.99)} ms",
        flush=True,
    )


def percentile(entry: Any, q: float) -> str:
    return f"{entry.get_response_time_percentile(q):.0f}"
