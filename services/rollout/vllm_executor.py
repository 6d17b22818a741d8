"""vLLM's multiprocess executor, with both sides of the worker queues blocking instead of spinning.

Each engine step the engine core sends the batch to the model worker process over a shared-memory queue
and waits for the result. vLLM's readers spin on those queues (`sched_yield` in a loop) for a second
after every message, which keeps each wait short on a GPU host, where the worker computes on the device.
On a CPU host the worker computes with OpenMP threads on the same cores, and a spinning reader takes
cycles from them. Two such readers:

- the engine core, waiting for the worker's result of every step: generation of the bench model on two
  cores ran ~8 % faster with it asleep on the queue's notification socket (alternating A/B rounds);
- the worker, waiting for the next batch: after every batch it spun for another second (~1 CPU second
  measured), which on an on-policy loop is exactly when the learner starts on the same cores.

With both blocking, a step costs one socket wake-up each way (tens of microseconds).
Selected with `VllmEngine(worker_wait="block")` (replica config `engine.worker_wait`, default on CPU).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.logger import init_logger
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

log = init_logger("vllm.rlfabric.executor")
"""Under vLLM's logger, whose handler the engine-core process sets up (a plain logger there has none)."""
BLOCKING_MESSAGE = "worker queues wait without spinning"


def stop_spinning(queues: list[Any]) -> int:
    """Make every reader side among `queues` block on its notification socket; how many were readers."""
    readers = 0
    for queue in queues:
        condition: Any = getattr(queue, "_spin_condition", None)
        if condition is not None and getattr(condition, "is_reader", False):
            condition.busy_loop_s = 0.0
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
