"""The loop on separate hosts: network namespaces joined by a bridge (`hosts.Network`), no loopback between
services. Redis and the coordinator run on one host, the reward service, a vLLM replica and the learner on
one each; every service binds its host's address, and the replica binds 0.0.0.0 and announces its address
through `advertise_address`. The test process is a host of its own on the bridge.

Proven across hosts: the address the replica registers (the coordinator dispatches to it), the run's REST
API, Redis, the reward service; a partition (the replica's link down, then up) heals with nothing lost;
a broadcast of weights from a sender on another host, at the address that sender announces; published
weights in an S3-compatible object store (moto's server) on a fifth host, which the learner writes and the
replica reads over the bridge. Elsewhere weights travel through a file path every host shares (one
filesystem), as through a shared volume.

Needs root and iproute2: the tests fail, not skip, where namespaces cannot be made.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import hosts
import pytest
import s3fs
import torch
from fault_stack import CREDENTIALS, RUN, Place, Stack, free_port, run_spec
from hosts import Host, Network
from safetensors.torch import load_file

from rlfabric.contracts import keys, wire
from rlfabric.local.procs import ServiceProcess
from rlfabric.tools import ledger
from rlfabric.tools.tiny_model import make_tiny_model
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from rlfabric.weights import broadcast

pytestmark = pytest.mark.vllm
HERE = Path(__file__).resolve().parent
ROLES = {
    "redis": "data",
    "coordinator": "data",
    "reward": "reward",
    "rollout": "rollout",
    "learner": "learner",
}
BUCKET = "rlfabric-weights"
S3_PORT = 9000


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    net = Network()
    try:
        for name in ("data", "reward", "rollout", "learner", "store"):
            net.add_host(name)
        net.check_reachable(net.hosts[3], net.hosts[0])  # learner -> data crosses the bridge
        net.check_reachable_from_here(net.hosts[0])  # and so does the test process -> data
        yield net
    finally:
        net.close()


def host(network: Network, name: str) -> Host:
    return next(h for h in network.hosts if h.netns.endswith(f"-{name}"))


def make_stack(
    folder: Path,
    network: Network,
    model: Path,
    vllm_env: dict[str, str],
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Stack:
    places = {
        role: Place(host(network, name).address, host(network, name).prefix) for role, name in ROLES.items()
    }
    folder.mkdir(parents=True)
    spec = run_spec(folder, model, **overrides)
    stack = Stack(folder, spec, engine="vllm", vllm_env=vllm_env, places=places, env=env)
    stack.replica_binds_every_interface = True
    return stack


@pytest.fixture(scope="module")
def finished(
    network: Network, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, vllm_env: dict[str, str]
) -> Iterator[Stack]:
    """A run through the whole loop across the hosts, completed; its processes stay up for the tests."""
    stack = make_stack(tmp_path_factory.mktemp("hosts") / "run", network, tiny_model_dir, vllm_env)
    try:
        started = time.monotonic()
        stack.start()
        stack.finish()
        print(f"run across hosts: {time.monotonic() - started:.0f} s")
        yield stack
    finally:
        stack.stop()


def replica_address(stack: Stack) -> str:
    assert stack.client is not None
    address = stack.client.hget(keys.replica(stack.spec.name, "rollout-0"), "address")
    assert address, "the replica is not in the registry"
    return address.decode()


def registered(stack: Stack) -> bool:
    assert stack.client is not None
    return bool(stack.client.exists(keys.replica(stack.spec.name, "rollout-0")))


def test_a_network_steps_over_a_subnet_an_earlier_run_left_behind() -> None:
    """A namespace that a killed run left on the subnet this run would pick still answers for its
    addresses (connection refused, from a stranger): the new network takes another subnet, and the test
    process reaches its host."""
    subnet = hosts.free_subnet(os.getpid())
    stray = f"rlfstray{os.getpid()}"
    try:
        hosts.sh("ip", "link", "add", f"{stray}br", "type", "bridge")
        hosts.sh("ip", "addr", "add", f"{subnet}.254/24", "dev", f"{stray}br")
        hosts.sh("ip", "link", "set", f"{stray}br", "up")
        net = Network()
        try:
            assert net.subnet != subnet
            net.check_reachable_from_here(net.add_host("data"))
        finally:
            net.close()
    finally:
        hosts.sh("ip", "link", "del", f"{stray}br")


def test_a_run_across_hosts_completes_and_its_books_balance(finished: Stack, network: Network) -> None:
    address = replica_address(finished)
    assert address.startswith(f"{host(network, 'rollout').address}:")  # advertised, not 0.0.0.0
    assert finished.url.startswith(f"http://{host(network, 'data').address}:")
    finished.assert_every_step_trained()
    finished.books()


def test_a_broadcast_from_another_host_reaches_the_replica(
    finished: Stack, network: Network, tmp_path: Path
) -> None:
    """The sender runs on the learner's host and announces that host's address; the replica's engine
    worker joins it from the rollout host (gloo binds the address that routes to the sender)."""
    model = make_tiny_model(tmp_path / "new", seed=13)
    sender_host, port = host(network, "learner"), free_port()
    sender = ServiceProcess(
        "sender",
        [
            *sender_host.prefix,
            sys.executable,
            str(HERE / "send_weights.py"),
            str(model),
            sender_host.address,
            str(port),
        ],
        log_path=tmp_path / "sender.log",
    )
    metas = broadcast.metas_from_state_dict(state_dict_of(model))
    source = rollout_pb2.BroadcastSource(
        master_address=sender_host.address, master_port=port, rank=1, world_size=2, backend="gloo",
        tensors=wire.metas_to_proto(metas), bucket_bytes=1 << 20,
    )  # fmt: skip
    with grpc.insecure_channel(replica_address(finished)) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        try:
            sender.start("sending", timeout_s=60)
            request = rollout_pb2.UpdateWeightsRequest(version=1000, broadcast=source, timeout_seconds=120)
            reply = stub.UpdateWeights(
                request, metadata=bearer("RLFABRIC_LEARNER__PUBLISH_TOKEN"), timeout=150
            )
            match = sender.wait_for(r"sent (\{.*\})", timeout_s=60)
        finally:
            sender.stop(grace_s=5)
        info = stub.GetInfo(
            rollout_pb2.GetInfoRequest(), metadata=bearer("RLFABRIC_ROLLOUT__CLIENT_TOKEN"), timeout=10
        )
    assert reply.version == 1000 and re.search(r'"bytes": [1-9]', match.group(1))
    assert info.policy_version == 1000 and info.serving
    assert info.address == replica_address(finished)


def test_a_partitioned_replica_heals_and_the_books_balance(
    network: Network, tmp_path: Path, tiny_model_dir: Path, vllm_env: dict[str, str]
) -> None:
    """The replica's only link goes down mid-run for longer than its registry entry lives; once it is up
    again the replica re-registers, the run finishes, and nothing is lost or counted twice."""
    stack = make_stack(tmp_path / "run", network, tiny_model_dir, vllm_env)
    rollout = host(network, "rollout")
    try:
        stack.start()
        stack.wait_for_step(2)
        network.set_link(rollout, up=False)
        stack.wait(lambda: not registered(stack), 15, "the cut-off replica's registry entry expired")
        time.sleep(3)
        step_at_heal = stack.step()
        network.set_link(rollout, up=True)
        stack.wait(lambda: registered(stack), 60, "the replica registered again")
        stack.finish()
        print(f"partition healed: counters {stack.status()['counters']}")
        assert step_at_heal < stack.spec.train.steps  # the run was cut off mid-way, not after its end
        stack.assert_every_step_trained()
        stack.books()
    finally:
        network.set_link(rollout, up=True)
        stack.stop()


@pytest.fixture
def object_store(
    network: Network, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """moto's S3-compatible server on the store host with an empty bucket (made as an operator would); yields
    the variables that point fsspec/s3fs and botocore at it, as deploy/k8s/base/endpoints.env does for
    MinIO. The test process gets them too: it reads the bucket as one more client on the bridge."""
    store = host(network, "store")
    endpoint = f"http://{store.address}:{S3_PORT}"
    env = {
        "AWS_ACCESS_KEY_ID": "rlfabric-test", "AWS_SECRET_ACCESS_KEY": "rlfabric-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
    }  # fmt: skip
    moto = str(Path(sys.executable).with_name("moto_server"))
    argv = [*store.prefix, moto, "-H", store.address, "-p", str(S3_PORT)]
    server = ServiceProcess("s3", argv, log_path=tmp_path / "s3.log")
    try:
        server.start(r"Running on (http://\S+)", timeout_s=60)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        bucket_client().mkdir(BUCKET)
        yield env
    finally:
        server.stop(grace_s=5)


def bucket_client() -> s3fs.S3FileSystem:
    """A client of the object store, configured by the environment alone (as the services are)."""
    return s3fs.S3FileSystem(skip_instance_cache=True)


def test_weights_through_an_object_store_on_another_host(
    network: Network,
    object_store: dict[str, str],
    tmp_path: Path,
    tiny_model_dir: Path,
    vllm_env: dict[str, str],
) -> None:
    """The run's weights URL is s3:// on the store host: the learner publishes every version there, the
    replica (on its own host) loads the versions it serves from there, the run completes over REST and its
    books balance with the published versions read from the bucket. Nothing is published on the local
    filesystem; the final model is written there, beside the checkpoints."""
    url = f"s3://{BUCKET}/{RUN}/weights"
    stack = make_stack(
        tmp_path / "run", network, tiny_model_dir, vllm_env, env=object_store, weights={"url": url}
    )
    try:
        started = time.monotonic()
        stack.start()
        with served_versions(stack) as served:
            stack.finish()
            stack.wait(lambda: stack.spec.train.steps in served, 30, "the replica serves the last version")
        print(f"run with an object store across hosts: {time.monotonic() - started:.0f} s")
        stack.assert_every_step_trained()
        stack.books()
        books = ledger.read_books(stack.client, RUN, stack.run_dir / "checkpoints", weights_root=url)
    finally:
        stack.stop()
    in_bucket = committed_versions(url)
    assert in_bucket and in_bucket <= books.published  # the ledger read the bucket
    assert max(in_bucket) == max(books.metric_versions) == stack.spec.train.steps
    # The replica loads the newest announced version, so it may skip one the learner published while it
    # was loading (max_staleness 1); the bucket keeps the newest few. What the replica served, and what
    # every sample was generated with, was published, and only to the bucket (asserted below).
    published = books.published | set(books.metric_versions)
    assert served - {0} <= published, (served, published)
    sampled = {version for entry in books.entries for version in entry.versions}
    assert sampled <= served | published, (sampled, published)
    assert len(served - {0}) >= 2, served  # it followed the learner, not only the last version
    assert not (stack.run_dir / "weights").exists()
    # no version on the local filesystem: the one marker is the run's final model (`<run dir>/model`)
    assert list(tmp_path.rglob("COMMITTED")) == [stack.run_dir / "model" / "COMMITTED"]


def committed_versions(url: str) -> set[int]:
    """The versions whose COMMITTED marker is in the bucket, listed straight from the server."""
    markers = bucket_client().glob(f"{url}/v*/COMMITTED")
    return {int(marker.split("/")[-2].removeprefix("v")) for marker in markers}


@contextmanager
def served_versions(stack: Stack, every_s: float = 0.1) -> Iterator[set[int]]:
    """The versions the replica is seen serving (its GetInfo, polled) while the block runs. A version
    serves for at least a learner step (seconds), far longer than the poll's interval."""
    seen: set[int] = set()
    done = threading.Event()
    metadata = bearer("RLFABRIC_ROLLOUT__CLIENT_TOKEN")

    def watch(stub: rollout_pb2_grpc.RolloutServiceStub) -> None:
        while not done.wait(every_s):
            info = stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=metadata, timeout=10)
            if info.serving:
                seen.add(info.policy_version)

    with grpc.insecure_channel(replica_address(stack)) as channel:
        watcher = threading.Thread(target=watch, args=(rollout_pb2_grpc.RolloutServiceStub(channel),))
        watcher.start()
        try:
            yield seen
        finally:
            done.set()
            watcher.join()


def bearer(variable: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {CREDENTIALS[variable]}"),)


def state_dict_of(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
