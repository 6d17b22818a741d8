"""vLLM's multiprocess executor, with the scheduler blocking (not spinning) while the worker computes.

Each engine step the engine core sends the batch to the model worker process over a shared-memory queue
and waits for the result. vLLM's reader spins on that queue (`sched_yield` in a loop) for a second after
every message, which keeps the wait short on a GPU host, where the worker's compute runs on the device.
On a CPU host the worker's compute is its OpenMP threads on the same cores, and the spinning engine
core takes cycles from them: with two cores, generation of the bench model ran ~8 % faster when the
engine core slept on the queue's notification socket instead (`bench/e2e_trl.py`, docs/benchmarks.md).
The worker's side, waiting for the next batch, keeps spinning: it waits only while the scheduler works.

Selected with `VllmEngine(worker_wait="block")` (replica config `engine.worker_wait`, default on CPU).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

log = init_logger("vllm.rlfabric.executor")
"""Under vLLM's logger, whose handler the engine-core process sets up (a plain logger there has none)."""
BLOCKING_MESSAGE = "engine core waits for the worker without spinning"


class BlockingWaitExecutor(MultiprocExecutor):
    """`MultiprocExecutor` whose reads of worker responses never busy-loop."""

    def _post_init_executor(self) -> None:
        super()._post_init_executor()
        conditions = [getattr(queue, "_spin_condition", None) for queue in self.response_mqs]
        readers = [c for c in conditions if c is not None and getattr(c, "is_reader", False)]
        for condition in readers:
            condition.busy_loop_s = 0.0
        if readers and len(readers) == len(self.response_mqs):
            log.info("%s (%d worker queue(s))", BLOCKING_MESSAGE, len(readers))
        else:  # a vLLM whose queues changed shape: say so and run on, spinning
            log.warning("could not switch %d of %d worker queues to blocking waits",
                        len(self.response_mqs) - len(readers), len(self.response_mqs))  # fmt: skip
