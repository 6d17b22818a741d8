"""A pool of scorer worker processes, so CPU-heavy scorers never run on the server's event loop.

Each worker (`rlfabric.reward.worker`) is a subprocess speaking length-prefixed JSON over its stdin and
stdout: no pickle crosses the process boundary. Its first frame is the server's `ScorerPolicy`, so a
worker loads user code and sets sandbox limits exactly as the server process allows. A batch is split
into up to `size` chunks that score in parallel on idle workers, so one request uses every core and
concurrent requests queue for workers.

Deadlines are real: a chunk still running at its deadline, or whose caller gave up (the task is
cancelled, e.g. because the gRPC client cancelled), has its worker killed and replaced, and its items
end as "timeout". A worker that dies (a scorer crashed the interpreter) is replaced and its chunk's
items end as "scorer_error". Invariant: every item of a batch gets exactly one result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter

from rlfabric.reward.scorers import ScoreResult
from rlfabric.reward.scorers.policy import ScorerPolicy
from rlfabric.reward.worker import HEADER

log = logging.getLogger(__name__)

# Time a worker gets beyond the job's own deadline to answer before it is killed.
KILL_SLACK_S = 1.0
# Items below which a batch is not worth splitting further.
MIN_CHUNK = 4

_RESTARTS = Counter("rlfabric_reward_worker_restarts_total", "Scorer workers killed and replaced", ["reason"])


class WorkerDied(RuntimeError):
    """The worker process exited or closed its pipe in the middle of a job."""


class Worker:
    """One worker subprocess; `request` sends a job frame and waits for its answer frame."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, policy: ScorerPolicy) -> Worker:
        """Starts a worker and hands it the server's `policy` (its first frame) before any job."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rlfabric.reward.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        worker = cls(proc)
        ready = await worker.request(policy.to_json())
        if not ready.get("ready"):
            raise WorkerDied(f"worker {proc.pid} did not start: {ready}")
        return worker

    async def request(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        data = json.dumps(job).encode()
        self.proc.stdin.write(HEADER.pack(len(data)) + data)
        try:
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WorkerDied(f"worker {self.proc.pid} closed its input") from exc
        return await self.read_frame()

    async def read_frame(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            header = await self.proc.stdout.readexactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            return json.loads(await self.proc.stdout.readexactly(size))
        except asyncio.IncompleteReadError as exc:
            raise WorkerDied(f"worker {self.proc.pid} exited with {self.proc.returncode}") from exc

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    async def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.kill()
            await self.proc.wait()


class ScorerPool:
    """`size` worker processes and a queue of the idle ones, each building scorers under `policy`."""

    def __init__(self, size: int, policy: ScorerPolicy) -> None:
        self.size = size
        self.policy = policy
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        self._all: set[Worker] = set()
        self._respawns: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> None:
        """Starts every worker and waits until each has imported the scorers."""
        workers = await asyncio.gather(*(Worker.spawn(self.policy) for _ in range(self.size)))
        for worker in workers:
            self._all.add(worker)
            self._idle.put_nowait(worker)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._respawns):
            task.cancel()
        await asyncio.gather(*(w.close() for w in list(self._all)), return_exceptions=True)
        self._all.clear()

    async def score(
        self,
        spec: dict[str, Any],
        items: Sequence[dict[str, Any]],
        *,
        timeout_s: float,
        item_timeout_s: float | None,
        whole: bool = False,
    ) -> list[ScoreResult]:
        """Scores JSON-ready items with the scorer `spec` within `timeout_s`; one result per item. `whole`:
        in one chunk on one worker (a scorer whose scores depend on the whole call, `Scorer.whole_batch`)."""
        deadline = time.monotonic() + timeout_s
        chunks = [list(items)] if whole else split(list(items), self.size)
        parts = await asyncio.gather(*(self._score_chunk(spec, c, deadline, item_timeout_s) for c in chunks))
        return [result for part in parts for result in part]

    async def _score_chunk(
        self, spec: dict[str, Any], items: list[dict[str, Any]], deadline: float, item_timeout_s: float | None
    ) -> list[ScoreResult]:
        try:
            async with asyncio.timeout_at(loop_deadline(deadline)):
                worker = await self._idle.get()
        except TimeoutError:
            return timeouts(items, "no scorer worker became free before the deadline")
        remaining = max(deadline - time.monotonic(), 0.001)
        job = {"spec": spec, "items": items, "timeout_s": remaining, "item_timeout_s": item_timeout_s}
        try:
            answer = await asyncio.wait_for(worker.request(job), remaining + KILL_SLACK_S)
        except TimeoutError:
            self._replace(worker, "overran")
            return timeouts(items, f"scorer overran its deadline by {KILL_SLACK_S}s; worker killed")
        except WorkerDied as exc:
            self._replace(worker, "died")
            return [ScoreResult.error(f"scorer worker died: {exc}")] * len(items)
        except asyncio.CancelledError:
            self._replace(worker, "cancelled")
            raise
        results = parse_answer(answer, len(items))
        if any(r.status == "timeout" for r in results):
            # The worker abandoned a scorer thread that may still be running: start a clean one.
            self._replace(worker, "abandoned")
        else:
            self._idle.put_nowait(worker)
        return results

    def _replace(self, worker: Worker, reason: str) -> None:
        """Kills `worker` and starts a replacement in the background."""
        worker.kill()
        self._all.discard(worker)
        _RESTARTS.labels(reason).inc()
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._respawn())
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _respawn(self) -> None:
        while not self._closed:
            try:
                worker = await Worker.spawn(self.policy)
            except (OSError, WorkerDied):
                log.exception("could not start a scorer worker; retrying in 1 s")
                await asyncio.sleep(1)
                continue
            self._all.add(worker)
            self._idle.put_nowait(worker)
            return


def loop_deadline(monotonic_deadline: float) -> float:
    """A `time.monotonic()` deadline on the event loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


def split(items: list[dict[str, Any]], ways: int) -> list[list[dict[str, Any]]]:
    """Contiguous chunks, at most `ways` of them and none smaller than MIN_CHUNK (unless all are)."""
    count = max(1, min(ways, math.ceil(len(items) / MIN_CHUNK)))
    size = math.ceil(len(items) / count)
    return [items[i : i + size] for i in range(0, len(items), size)] or [[]]


def timeouts(items: Sequence[Any], message: str) -> list[ScoreResult]:
    return [ScoreResult.timed_out(message)] * len(items)


def parse_answer(answer: dict[str, Any], expected: int) -> list[ScoreResult]:
    if "error" in answer:
        return [ScoreResult.error(str(answer["error"]))] * expected
    results = [
        ScoreResult(float(r["reward"]), r["components"], r["status"], r["message"]) for r in answer["results"]
    ]
    if len(results) != expected:
        return [ScoreResult.error(f"worker returned {len(results)} results for {expected} items")] * expected
    return results
