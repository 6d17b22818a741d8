"""Network faults between the coordinator and the services it calls, through `tcp_proxy.FaultProxy` (a
real TCP proxy on loopback): added latency, connections reset, a stalled peer. The reward service is
reached only through the proxy; a rollout replica is reached both directly and through the proxy (the
test registers the proxied address in the registry as a second replica). Each run completes and its
ledger balances.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from fault_stack import Stack
from tcp_proxy import FaultProxy

from rlfabric.contracts import keys

pytestmark = pytest.mark.faults_full


@pytest.fixture
def reward_stack(make_stack: Callable[..., Stack]) -> Iterator[tuple[Stack, FaultProxy]]:
    stack = make_stack(
        reward={"scorer": "length_penalty", "params": {"target_length": 4}, "item_timeout_s": 1}
    )
    proxy = FaultProxy(f"127.0.0.1:{stack.reward_port}").__enter__()
    stack.reward_address = proxy.address
    yield stack, proxy
    proxy.__exit__(None, None, None)


def test_reward_behind_a_slow_link(reward_stack: tuple[Stack, FaultProxy]) -> None:
    stack, proxy = reward_stack
    proxy.latency_s = 0.05  # every chunk, each way
    stack.start()
    stack.finish()
    stack.books()


def test_reward_connections_reset_mid_run(reward_stack: tuple[Stack, FaultProxy]) -> None:
    stack, proxy = reward_stack
    stack.start()
    stack.wait_for_step(1)
    for _ in range(5):
        proxy.reset_all()
        time.sleep(1.0)
    stack.finish()
    assert proxy.resets >= 5 and proxy.connections >= 2  # the coordinator reconnected
    stack.books()


def test_reward_peer_stalled_past_the_deadline(reward_stack: tuple[Stack, FaultProxy]) -> None:
    stack, proxy = reward_stack
    stack.start()
    stack.wait_for_step(1)
    proxy.stalled = True  # connections stay open, nothing moves: the Score deadline (34 s) must fire
    queued = stack.counters().get("groups_queued", 0)
    time.sleep(40)
    assert stack.counters().get("groups_queued", 0) <= queued + 1  # nothing got through meanwhile
    proxy.stalled = False
    stack.finish()
    stack.books()


class ProxiedReplica:
    """Keeps a registry entry for `replica_id` reached through `proxy`, mirroring the real entry."""

    def __init__(self, stack: Stack, replica_id: str, proxy: FaultProxy) -> None:
        self.stack, self.replica_id, self.proxy = stack, replica_id, proxy
        self.alias = f"{replica_id}-via-proxy"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.beat, daemon=True)

    def beat(self) -> None:
        client = redis.Redis.from_url(self.stack.redis_url, decode_responses=True)
        real = keys.replica(self.stack.spec.name, self.replica_id)
        alias = keys.replica(self.stack.spec.name, self.alias)
        while not self.stop.wait(0.3):
            entry = client.hgetall(real)
            if entry:
                entry.update(replica_id=self.alias, address=self.proxy.address)
                with client.pipeline() as pipe:
                    pipe.hset(alias, mapping=entry).pexpire(alias, 1500).execute()
        client.delete(alias)
        client.close()


@pytest.fixture
def rollout_proxy(make_stack: Callable[..., Stack]) -> Iterator[tuple[Stack, FaultProxy]]:
    stack = make_stack()
    stack.start()
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    upstream = client.hget(keys.replica(stack.spec.name, "rollout-0"), "address")
    client.close()
    assert upstream
    with FaultProxy(str(upstream)) as proxy:
        mirror = ProxiedReplica(stack, "rollout-0", proxy)
        mirror.thread.start()
        yield stack, proxy
        mirror.stop.set()
        mirror.thread.join(5)


def test_rollout_streams_reset_mid_generation_are_redispatched(
    rollout_proxy: tuple[Stack, FaultProxy],
) -> None:
    stack, proxy = rollout_proxy
    proxy.reset_after_bytes = 400  # every connection through the proxy breaks early in a stream
    stack.finish()
    assert proxy.resets >= 1
    assert stack.status()["counters"]["redispatches"] >= 1
    stack.books()


def test_rollout_behind_a_slow_link(rollout_proxy: tuple[Stack, FaultProxy]) -> None:
    stack, proxy = rollout_proxy
    proxy.latency_s = 0.05
    stack.finish()
    assert proxy.connections >= 1
    stack.books()


def test_rollout_peer_stalled_is_detected_and_redispatched(rollout_proxy: tuple[Stack, FaultProxy]) -> None:
    """Keepalive (30 s + 10 s in `make_channel`) closes a connection whose peer went silent; the calls on
    it fail and their groups are re-dispatched. The learner is held meanwhile: otherwise the run ends on
    the direct address before the stall is detected, and nothing would be proven."""
    stack, proxy = rollout_proxy
    stack.wait(lambda: proxy.connections >= 1, 60, "a connection through the proxy")  # it carries work
    stack.wait_for_step(1)
    learner = stack.procs["learner"]
    proxy.stalled = True
    learner.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        stack.wait(lambda: stack.counters().get("redispatches", 0) >= 1, 150, "a stalled call re-dispatched")
        detected_s = time.monotonic() - started
    finally:
        learner.signal(signal.SIGCONT)
    print(f"stalled rollout calls re-dispatched after {detected_s:.0f} s")
    assert detected_s < 75, detected_s  # keepalive (30 s + 10 s), not the 600 s Generate deadline
    stack.finish()
    stack.books()
