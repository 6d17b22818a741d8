"""A scorer worker process: reads scoring jobs from stdin, writes results to stdout.

Started by `rlfabric.reward.pool.ScorerPool` as `python -m rlfabric.reward.worker`. Frames are a 4-byte
big-endian length followed by UTF-8 JSON, both ways (never pickle). The worker answers one job at a time;
the parent kills it when a job overruns its deadline or its caller gives up, and starts a new one.

Job:    {"spec": {"name": str, "params": {...}}, "items": [item, ...], "timeout_s": float | null,
         "item_timeout_s": float | null}
        item = {"id", "prompt" (str or chat messages), "completion", "reference", "metadata"}
Result: {"results": [{"reward", "components", "status", "message"}, ...]}  (same order as the items)
        or {"error": str} when the spec cannot be built (the parent validates specs first).
First frame read at start: the server's scorer policy, `ScorerPolicy.to_json()` (allowed_functions and
the sandbox limits); every scorer here is built under it. Then written: {"ready": true}.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

HEADER = struct.Struct(">I")


def read_frame(stream: BinaryIO) -> dict[str, Any] | None:
    """The next frame, or None at end of input."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return json.loads(stream.read(size))


def write_frame(stream: BinaryIO, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def protocol_stdout() -> BinaryIO:
    """A private handle on the real stdout; fd 1 then points at stderr, so a scorer that prints (a user
    function, a library) cannot corrupt the frames."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def make_handler(policy_json: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Imports the scorers once and returns the job handler, which builds scorers under the policy and
    caches them by spec."""
    from rlfabric.reward.scorers import InvalidScorerSpec, ScoreInput, build_scorer, run_scorer
    from rlfabric.reward.scorers.policy import ScorerPolicy

    policy = ScorerPolicy.from_json(policy_json)
    cache: dict[str, Any] = {}

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        key = json.dumps(job["spec"], sort_keys=True)
        if key not in cache:
            try:
                cache[key] = build_scorer(job["spec"]["name"], job["spec"].get("params") or {}, policy)
            except InvalidScorerSpec as exc:
                return {"error": str(exc)}
        items = [ScoreInput(**item) for item in job["items"]]
        results = run_scorer(
            cache[key], items, job.get("timeout_s"), item_timeout_s=job.get("item_timeout_s")
        )
        return {"results": [result_to_json(r) for r in results]}

    return handle


def result_to_json(result: Any) -> dict[str, Any]:
    return {
        "reward": result.reward,
        "components": result.components,
        "status": result.status,
        "message": result.message,
    }


def main() -> None:
    out = protocol_stdout()
    policy = read_frame(sys.stdin.buffer)
    if policy is None:
        return
    handle = make_handler(policy)
    write_frame(out, {"ready": True})
    while (job := read_frame(sys.stdin.buffer)) is not None:
        write_frame(out, handle(job))


if __name__ == "__main__":
    main()
