"""Structured logging for every service: one JSON object per line (or plain text for a terminal).

Each JSON record holds `ts` (UTC, ISO 8601, milliseconds), `level`, `logger`, `msg`, `service`, every
field passed with `logger.info("...", extra={...})`, `exc` when an exception is attached, and `trace_id` /
`span_id` when a span is active, so a log line can be found from its trace and back.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import signal
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from types import FrameType
from typing import Any, Literal, TextIO

from rlfabric.runtime.telemetry import current_ids

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_HANDLER_MARK = "_rlfabric_handler"


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON; values that JSON cannot hold are written with `str()`."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        """The record as a single-line JSON object (never contains a raw newline)."""
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "service": self.service,
        }
        entry.update((k, v) for k, v in vars(record).items() if k not in _RECORD_ATTRS)
        ids = current_ids()
        if ids is not None:
            entry["trace_id"], entry["span_id"] = ids
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(
    service: str,
    level: str | int = "INFO",
    fmt: Literal["json", "text"] = "json",
    *,
    stream: TextIO | None = None,
) -> None:
    """Routes the root logger to `stream` (stderr by default) in the chosen format.

    Idempotent: the handler a previous call installed is replaced, never duplicated; handlers installed
    by others (pytest's capture, for instance) are left alone.
    """
    formatter = _formatter(service, fmt)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


def enable_stack_dumps() -> None:
    """Every thread's Python stack on stderr when asked and when the process dies of a fatal signal.

    `kill -USR1 PID` writes the stacks of a service that seems stuck and lets it go on: the first thing to
    look at when a run stops making progress. The threads' stacks come at once, even when the interpreter
    is blocked (faulthandler); then, as soon as the event loop runs Python again, the stack of each of its
    asyncio tasks, which shows the `await` a coroutine waits at (a thread's stack shows only the loop's
    `select`). A crash in native code (SIGSEGV, SIGABRT, ...) writes the threads' stacks before the process
    dies. Send the signal to the service's own PID only: a vLLM replica's engine processes do not handle
    it, and SIGUSR1's default action ends a process. Call it from the main thread.
    """
    signal.signal(signal.SIGUSR1, _dump_asyncio_tasks)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)


def _dump_asyncio_tasks(signum: int, frame: Any) -> None:
    """Writes the stack of every task of the event loop running in the main thread (if one runs)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no event loop runs in this thread
        return
    print(asyncio_task_stacks(loop), file=sys.stderr, flush=True)


def asyncio_task_stacks(loop: asyncio.AbstractEventLoop) -> str:
    """The stack of each task of `loop`, down the chain of `await`s. Meant for a diagnostic written from a
    signal handler or another thread, so it never raises: a failure is described instead."""
    try:
        tasks = asyncio.all_tasks(loop)
        lines = [f"{len(tasks)} asyncio task(s) (most recent call last):"]
        for task in tasks:
            lines.append(f"Task {task.get_name()} ({task.get_coro()!r}):")
            lines += [
                f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}'
                for f in _await_chain(task.get_coro())
            ]
        return "\n".join(lines)
    except Exception as exc:
        return f"asyncio tasks not written: {exc!r}"


def _await_chain(coro: Any) -> Iterator[FrameType]:
    """The frames of a suspended coroutine down the chain of `await`s to the innermost one (a task's own
    `get_stack` stops at the outermost)."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            yield frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


def _formatter(service: str, fmt: Literal["json", "text"]) -> logging.Formatter:
    """The formatter for `fmt`; anything but "json" or "text" is an error."""
    if fmt == "json":
        return JsonFormatter(service)
    if fmt == "text":
        return logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
    raise ValueError(f"log format must be 'json' or 'text', not {fmt!r}")
