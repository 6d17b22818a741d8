"""vLLM's multiprocess executor, with both sides of the worker queues blocking instead of spinning.

Each engine step the engine core sends the batch to the model worker process over a shared-memory queue
and waits for the result. vLLM's readers spin on those queues (`sched_yield` in a loop) for a second
after every message, which keeps each wait short on a GPU host, where the worker computes on the device.
On a CPU host the worker computes with OpenMP threads on the same cores, and a spinning reader takes
cycles from them. Two such readers:

- the engine core, waiting for the worker's result of every step;
- the worker, waiting for the next batch: after every batch it spun for another second (~1 CPU second
  measured), which on an on-policy loop is exactly when the learner starts on the same cores.

A blocking reader sleeps in `poll` on the queue's ZeroMQ notification socket, but that notification is not
reliable: the writer's PUB socket has a send limit of one message and silently drops a notification when
the previous one still counts as queued (measured on two busy cores: about one per 1,000 steps). vLLM's
reader then re-reads the shared-memory flag only after `SHM_READER_RECHECK_INTERVAL_MS` (5 s), so a
dropped notification stalled a step by up to 5 s (`Poller timed out` in vLLM's debug log; on a 2-core AVX2
host generation of the bench model fell from ~1,000 to ~70 tokens/s). Here a reader's `poll` never sleeps
longer than `recheck_ms` of the time it has waited so far: the flag in shared memory, not the
notification, decides, and a dropped notification costs at most `RECHECK_FRACTION` of the wait it
interrupts (a few ms during generation), while an idle reader wakes at most once per `RECHECK_MAX_MS`.

Selected with `VllmEngine(worker_wait="block")` (replica config `engine.worker_wait`, default on CPU).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import zmq
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.logger import init_logger
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

log = init_logger("vllm.rlfabric.executor")
"""Under vLLM's logger, whose handler the engine-core process sets up (a plain logger there has none)."""
BLOCKING_MESSAGE = "worker queues wait without spinning"
RECHECK_MIN_MS = 1
"""Shortest sleep between two reads of the shared-memory flag (right after the reader's last message)."""
RECHECK_FRACTION = 0.5
"""A sleep is at most this fraction of the time the reader has already waited since its last message."""
RECHECK_MAX_MS = 1000
"""Longest sleep: an idle reader wakes once a second (vLLM's own bound is 5 s)."""


def recheck_ms(waited_s: float) -> int:
    """How long a reader that has waited `waited_s` since its last message may sleep before it re-reads
    the flag: `RECHECK_FRACTION` of that wait, within [`RECHECK_MIN_MS`, `RECHECK_MAX_MS`]. The sleeps
    of one wait grow geometrically (~log(wait) wake-ups), and a lost notification delays the reader by
    at most max(RECHECK_MIN_MS, RECHECK_FRACTION x the wait so far)."""
    return int(min(max(waited_s * 1000 * RECHECK_FRACTION, RECHECK_MIN_MS), RECHECK_MAX_MS))


def bounded_wait(condition: Any, timeout_ms: int | None = None) -> None:
    """`SpinCondition.wait` for a reader, without the busy loop and with the sleep bounded by
    `recheck_ms`: returns on a notification, a cancellation (shutdown) or the bound; the caller
    (`MessageQueue.acquire_read`) then re-reads the flag and calls again if nothing was written."""
    sleep_ms = recheck_ms(time.monotonic() - condition.last_read)
    if timeout_ms is not None:
        sleep_ms = min(sleep_ms, timeout_ms)
    events = dict(condition.poller.poll(timeout=sleep_ms))
    if condition.local_notify_socket in events:  # one pending message at most (the socket conflates)
        condition.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)


def stop_spinning(queues: list[Any]) -> int:
    """Make every reader side among `queues` wait with `bounded_wait`; how many were readers."""
    readers = 0
    for queue in queues:
        condition: Any = getattr(queue, "_spin_condition", None)
        if condition is not None and getattr(condition, "is_reader", False):
            condition.wait = partial(bounded_wait, condition)
            readers += 1
    return readers


def stop_worker_spinning(worker: Any) -> int:
    """Run in the worker process (`collective_rpc`): its queue readers, found among live objects (the
    worker process holds them; the worker object does not reference them)."""
    import gc

    return stop_spinning([o for o in gc.get_objects() if isinstance(o, MessageQueue)])


class BlockingWaitExecutor(MultiprocExecutor):
    """`MultiprocExecutor` whose engine core and workers never busy-loop on their queues."""

    def _post_init_executor(self) -> None:
        super()._post_init_executor()
        core = stop_spinning(list(self.response_mqs))
        workers = self.collective_rpc(stop_worker_spinning)
        if core == len(self.response_mqs) and all(n >= 1 for n in workers):
            log.info("%s (engine core: %d, workers: %s)", BLOCKING_MESSAGE, core, workers)
        else:  # a vLLM whose queues changed shape: say so and run on, spinning
            log.warning("could not switch every worker queue to blocking waits (engine core: %d of %d, "
                        "workers: %s)", core, len(self.response_mqs), workers)  # fmt: skip
