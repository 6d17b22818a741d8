"""The shared gRPC plumbing against a real server on an ephemeral loopback port.

A small RewardService servicer stands in for a real service: its Score can be made to block on an
asyncio.Event (to hold RPCs in flight) or to raise, and ListScorers answers at once (or fails a set
number of times with UNAVAILABLE, to exercise client retries).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY

from rlfabric.runtime import errors, telemetry
from rlfabric.runtime.grpc_client import ClientTls, health_check, make_channel, wait_ready
from rlfabric.runtime.grpc_server import (
    HEALTH_SERVICE,
    REFLECTION_SERVICE,
    GrpcServer,
    GrpcServerOptions,
    TlsFiles,
    check_bearer,
    full_service_name,
)
from rlfabric.runtime.metrics import start_metrics_server, stop_metrics_server
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

REWARD = full_service_name(reward_pb2, "RewardService")
TICKER = "rlfabric.test.Ticker"
MAX_MESSAGE = 1 << 20


class FakeReward(reward_pb2_grpc.RewardServiceServicer):
    """Score blocks while `block` is set and raises `fail_with` if set; ListScorers fails
    `list_failures` times with UNAVAILABLE, then answers; `token` turns on the bearer check."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.block = False
        self.fail_with: BaseException | None = None
        self.entered = 0
        self.score_calls = 0
        self.list_calls = 0
        self.list_failures = 0
        self.token: str | None = None

    async def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        self.score_calls += 1
        if self.fail_with is not None:
            raise self.fail_with
        self.entered += 1
        if self.block:
            await self.release.wait()
        return reward_pb2.ScoreResponse(results=[reward_pb2.ItemScore(id=i.id) for i in request.items])

    async def ListScorers(
        self, request: reward_pb2.ListScorersRequest, context: Any
    ) -> reward_pb2.ListScorersResponse:
        check_bearer(context, self.token)
        self.list_calls += 1
        if self.list_calls <= self.list_failures:
            raise errors.Unavailable("warming up")
        return reward_pb2.ListScorersResponse(scorers=[reward_pb2.ScorerDescription(name="exact_match")])


class Ticker:
    """A raw-bytes server-streaming service: `Tick(b"n")` yields n ticks, pausing on `gate` after the
    first; `Tick(b"fail")` raises after one tick."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def Tick(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"tick"
        if request == b"fail":
            raise RuntimeError("tick failed")
        await self.gate.wait()
        for _ in range(int(request) - 1):
            yield b"tick"


def add_ticker(servicer: Ticker, server: grpc.aio.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        TICKER, {"Tick": grpc.unary_stream_rpc_method_handler(servicer.Tick)}
    )
    server.add_generic_rpc_handlers((handler,))


@dataclass
class Running:
    server: GrpcServer
    reward: FakeReward
    ticker: Ticker
    target: str
    channel: grpc.aio.Channel

    @property
    def stub(self) -> reward_pb2_grpc.RewardServiceStub:
        return reward_pb2_grpc.RewardServiceStub(self.channel)


async def start_server(options: GrpcServerOptions) -> tuple[GrpcServer, FakeReward, Ticker, int]:
    reward, ticker = FakeReward(), Ticker()
    server = GrpcServer(options)
    server.add_servicer(reward_pb2_grpc.add_RewardServiceServicer_to_server, reward, REWARD)
    server.add_servicer(add_ticker, ticker, TICKER)
    port = await server.start()
    return server, reward, ticker, port


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    options = GrpcServerOptions(max_concurrent_rpcs=2, max_message_bytes=MAX_MESSAGE, grace_period_s=2.0)
    server, reward, ticker, port = await start_server(options)
    target = f"127.0.0.1:{port}"
    channel = make_channel(target)
    yield Running(server, reward, ticker, target, channel)
    reward.release.set()
    ticker.gate.set()
    await channel.close(None)
    await server.stop(0)


async def until(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def score_request(*ids: str, completion: str = "") -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=i, completion=completion) for i in ids])


def handled(method: str, code: str) -> float:
    value = REGISTRY.get_sample_value(
        "rlfabric_grpc_server_handled_total", {"method": f"/{REWARD}/{method}", "code": code}
    )
    return value or 0.0


async def test_health_reports_the_server_and_each_service(running: Running) -> None:
    assert await health_check(running.target) == "SERVING"
    assert await health_check(running.channel, REWARD) == "SERVING"
    assert await health_check(running.channel, "no.such.Service") == "SERVICE_UNKNOWN"
    await running.server.set_serving(REWARD, False)
    assert await health_check(running.channel, REWARD) == "NOT_SERVING"
    assert await health_check(running.channel, "") == "SERVING"


async def test_reflection_lists_and_describes_the_services(running: Running) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(running.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert names == {REWARD, TICKER, HEALTH_SERVICE, REFLECTION_SERVICE}

    def describe() -> list[str]:
        with grpc.insecure_channel(running.target) as sync_channel:
            database = ProtoReflectionDescriptorDatabase(sync_channel)
            return [m.name for m in database.FindFileContainingSymbol(REWARD).service[0].method]

    assert await asyncio.to_thread(describe) == ["Score", "ListScorers", "CheckScorer"]


async def test_load_past_the_limit_is_shed_while_health_answers(running: Running) -> None:
    running.reward.block = True
    held = [asyncio.ensure_future(running.stub.Score(score_request(str(i)))) for i in range(2)]
    await until(lambda: running.reward.entered == 2)

    with pytest.raises(grpc.aio.AioRpcError) as shed:
        await running.stub.ListScorers(reward_pb2.ListScorersRequest())
    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 2 concurrent RPCs" in (shed.value.details() or "")
    assert await health_check(running.channel) == "SERVING"

    running.reward.release.set()
    assert [(await call).results[0].id for call in held] == ["0", "1"]
    assert running.server.in_flight == 0
    assert (await running.stub.ListScorers(reward_pb2.ListScorersRequest())).scorers[0].name == "exact_match"


async def test_in_flight_count_is_released_on_cancel_error_and_stream_end(running: Running) -> None:
    running.reward.block = True
    blocked = running.stub.Score(score_request("a"))
    await until(lambda: running.server.in_flight == 1)
    blocked.cancel()
    await until(lambda: running.server.in_flight == 0)

    tick = running.channel.unary_stream(f"/{TICKER}/Tick")  # type: ignore[call-arg]
    stream = tick(b"3")
    assert await stream.read() == b"tick"
    assert running.server.in_flight == 1
    stream.cancel()
    await until(lambda: running.server.in_flight == 0)

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        _ = [m async for m in tick(b"fail")]
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert running.server.in_flight == 0

    running.ticker.gate.set()
    assert [m async for m in tick(b"3")] == [b"tick"] * 3
    assert running.server.in_flight == 0


async def test_oversized_message_is_refused_and_the_server_keeps_serving(running: Running) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await running.stub.Score(score_request("big", completion="x" * (MAX_MESSAGE + 1)))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert running.reward.score_calls == 0
    assert (await running.stub.Score(score_request("small"))).results[0].id == "small"


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidArgument,
        errors.NotFound,
        errors.FailedPrecondition,
        errors.ResourceExhausted,
        errors.Unauthenticated,
        errors.Unavailable,
        errors.DeadlineExceeded,
    ],
)
async def test_service_error_becomes_its_status_code(
    running: Running, error: type[errors.ServiceError]
) -> None:
    running.reward.fail_with = error("unknown scorer 'nope'")
    before = handled("Score", error.code.name)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await running.stub.Score(score_request("a"))
    assert failed.value.code() == error.code
    assert failed.value.details() == "unknown scorer 'nope'"
    # abort() sends the status before the interceptor's bookkeeping runs: the count follows shortly.
    await until(lambda: handled("Score", error.code.name) == before + 1)


async def test_unexpected_exception_is_internal_and_the_server_keeps_serving(running: Running) -> None:
    running.reward.fail_with = KeyError("secret-internal-detail")
    labels = {"method": f"/{REWARD}/Score", "exception": "KeyError"}
    before = REGISTRY.get_sample_value("rlfabric_grpc_server_unexpected_errors_total", labels) or 0.0
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await running.stub.Score(score_request("a"))
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "KeyError" in (failed.value.details() or "")
    assert "secret-internal-detail" not in (failed.value.details() or "")
    assert REGISTRY.get_sample_value("rlfabric_grpc_server_unexpected_errors_total", labels) == before + 1
    running.reward.fail_with = None
    assert (await running.stub.Score(score_request("b"))).results[0].id == "b"


async def test_default_deadline_applies_when_the_caller_sets_none(running: Running) -> None:
    running.reward.block = True
    before = handled("Score", "DEADLINE_EXCEEDED")
    async with make_channel(running.target, default_timeout_s=0.2) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await reward_pb2_grpc.RewardServiceStub(channel).Score(score_request("a"))
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: running.server.in_flight == 0)
    assert handled("Score", "DEADLINE_EXCEEDED") == before + 1


async def test_bearer_token_is_required_when_configured(running: Running) -> None:
    running.reward.token = "s3cret"
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await running.stub.ListScorers(reward_pb2.ListScorersRequest())
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with make_channel(running.target, bearer_token="wrong") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await reward_pb2_grpc.RewardServiceStub(channel).ListScorers(reward_pb2.ListScorersRequest())
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with make_channel(running.target, bearer_token="s3cret") as channel:
        await reward_pb2_grpc.RewardServiceStub(channel).ListScorers(reward_pb2.ListScorersRequest())


async def test_idempotent_methods_are_retried_on_unavailable_and_others_are_not(running: Running) -> None:
    running.reward.list_failures = 1
    async with make_channel(running.target, retry_methods=[(REWARD, "ListScorers")]) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        assert (await stub.ListScorers(reward_pb2.ListScorersRequest())).scorers[0].name == "exact_match"
        assert running.reward.list_calls == 2

        running.reward.fail_with = errors.Unavailable("draining")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.Score(score_request("a"))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert running.reward.score_calls == 1


async def test_graceful_stop_lets_in_flight_rpcs_finish(running: Running) -> None:
    running.reward.block = True
    call = asyncio.ensure_future(running.stub.Score(score_request("last")))
    await until(lambda: running.reward.entered == 1)
    started = time.monotonic()
    stopping = asyncio.ensure_future(running.server.stop(grace=5.0))
    await asyncio.sleep(0.2)
    assert not call.done()
    running.reward.release.set()
    assert (await call).results[0].id == "last"
    await stopping
    assert time.monotonic() - started < 2.0


async def test_stop_cancels_what_is_still_running_after_the_grace_period(running: Running) -> None:
    running.reward.block = True
    call = asyncio.ensure_future(running.stub.Score(score_request("stuck")))
    await until(lambda: running.reward.entered == 1)
    started = time.monotonic()
    await running.server.stop(grace=0.3)
    assert time.monotonic() - started < 2.0
    with pytest.raises(grpc.aio.AioRpcError):
        await call
    assert running.server.in_flight == 0


async def test_rpc_spans_follow_the_semantic_conventions(running: Running) -> None:
    """caller -> CLIENT span -> SERVER span, one trace, named "{rpc.service}/{rpc.method}"; a stream's
    CLIENT span ends with the stream, carrying its status code."""
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("test", exporter=exporter)
    tick = running.channel.unary_stream(f"/{TICKER}/Tick")  # type: ignore[call-arg]
    try:
        with telemetry.span("caller") as caller:
            await running.stub.ListScorers(reward_pb2.ListScorersRequest())
            with pytest.raises(grpc.aio.AioRpcError):
                _ = [m async for m in tick(b"fail")]
        await until(lambda: len(exporter.get_finished_spans()) == 5)
    finally:
        telemetry.shutdown_tracing()
    spans = {(s.name, s.kind): s for s in exporter.get_finished_spans()}
    client = spans[(f"{REWARD}/ListScorers", SpanKind.CLIENT)]
    server = spans[(f"{REWARD}/ListScorers", SpanKind.SERVER)]
    assert client.parent is not None and client.parent.span_id == caller.get_span_context().span_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.context.trace_id == caller.get_span_context().trace_id
    rpc = {"rpc.system": "grpc", "rpc.service": REWARD, "rpc.method": "ListScorers"}
    assert dict(server.attributes or {}) == {**rpc, "rpc.grpc.status_code": 0}
    host, port = running.target.split(":")
    assert dict(client.attributes or {}) == {
        **rpc, "rpc.grpc.status_code": 0, "server.address": host, "server.port": int(port)
    }  # fmt: skip
    internal = grpc.StatusCode.INTERNAL.value[0]
    for kind in (SpanKind.CLIENT, SpanKind.SERVER):
        failed = spans[(f"{TICKER}/Tick", kind)]
        assert (failed.attributes or {})["rpc.grpc.status_code"] == internal
        assert (failed.attributes or {})["rpc.method"] == "Tick"


async def test_metrics_endpoint_exposes_rpc_counters(running: Running) -> None:
    await running.stub.ListScorers(reward_pb2.ListScorersRequest())
    port = start_metrics_server("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    finally:
        stop_metrics_server(port)
    assert f'rlfabric_grpc_server_handled_total{{code="OK",method="/{REWARD}/ListScorers"}}' in body


# --- mTLS ----------------------------------------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def write_pki(directory: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def issue(subject: str, key: Any, issuer_key: Any, issuer: str, *, ca: bool) -> x509.Certificate:
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(path: Path, cert: x509.Certificate, key: Any) -> None:
        path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    write(directory / "ca", issue("test-ca", ca_key, ca_key, "test-ca", ca=True), ca_key)
    write(directory / "server", issue("server", server_key, ca_key, "test-ca", ca=False), server_key)
    write(directory / "client", issue("client", client_key, ca_key, "test-ca", ca=False), client_key)
    return Pki(*(directory / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")))


async def test_mtls_refuses_clients_without_a_certificate(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    pki = write_pki(tmp_path)
    tls = TlsFiles(str(pki.server_cert), str(pki.server_key), client_ca_file=str(pki.ca))
    server, _, _, port = await start_server(GrpcServerOptions(tls=tls))
    target = f"127.0.0.1:{port}"
    try:
        anonymous = ClientTls(root_ca_file=str(pki.ca))
        async with make_channel(target, tls=anonymous) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await reward_pb2_grpc.RewardServiceStub(channel).ListScorers(
                    reward_pb2.ListScorersRequest(), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        identified = ClientTls(str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key))
        async with make_channel(target, tls=identified) as channel:
            await wait_ready(channel, 5.0)
            reply = await reward_pb2_grpc.RewardServiceStub(channel).ListScorers(
                reward_pb2.ListScorersRequest(), timeout=5
            )
            assert reply.scorers[0].name == "exact_match"
    finally:
        await server.stop(0)


# --- SIGTERM in a real process ---------------------------------------------------------------------

SERVER_SCRIPT = """
import asyncio

from rlfabric.runtime.grpc_server import GrpcServer, GrpcServerOptions
from rlfabric.v1 import reward_pb2, reward_pb2_grpc


class Slow(reward_pb2_grpc.RewardServiceServicer):
    async def Score(self, request, context):
        print("entered", flush=True)
        await asyncio.sleep(float(request.items[0].completion))
        return reward_pb2.ScoreResponse(results=[reward_pb2.ItemScore(id="done")])


async def main():
    server = GrpcServer(GrpcServerOptions(grace_period_s=GRACE))
    add = reward_pb2_grpc.add_RewardServiceServicer_to_server
    server.add_servicer(add, Slow(), "rlfabric.v1.RewardService")
    port = await server.start()
    server.install_signal_handlers()
    print(port, flush=True)
    await server.wait_for_termination()


asyncio.run(main())
"""
GRACE_S = 5.0


@pytest.fixture
def server_process() -> Iterator[subprocess.Popen[str]]:
    script = SERVER_SCRIPT.replace("GRACE", repr(GRACE_S))
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    yield process
    if process.poll() is None:
        process.kill()
        process.wait(timeout=5)
    assert process.stdout is not None
    process.stdout.close()


async def test_sigterm_drains_in_flight_rpcs_and_exits_zero(server_process: subprocess.Popen[str]) -> None:
    assert server_process.stdout is not None
    readline = server_process.stdout.readline
    port = int(await asyncio.wait_for(asyncio.to_thread(readline), 20))
    async with make_channel(f"127.0.0.1:{port}") as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        call = asyncio.ensure_future(stub.Score(score_request("a", completion="0.5"), timeout=10))
        assert (await asyncio.wait_for(asyncio.to_thread(readline), 10)).strip() == "entered"
        started = time.monotonic()
        server_process.send_signal(signal.SIGTERM)
        assert (await call).results[0].id == "done"
    returncode = await asyncio.to_thread(server_process.wait, GRACE_S)
    assert returncode == 0
    assert time.monotonic() - started < GRACE_S
