"""Structured logging for every service: one JSON object per line (or plain text for a terminal).

Each JSON record holds `ts` (UTC, ISO 8601, milliseconds), `level`, `logger`, `msg`, `service`, every
field passed with `logger.info("...", extra={...})`, `exc` when an exception is attached, and `trace_id` /
`span_id` when a span is active, so a log line can be found from its trace and back.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
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


def _formatter(service: str, fmt: Literal["json", "text"]) -> logging.Formatter:
    """The formatter for `fmt`; anything but "json" or "text" is an error."""
    if fmt == "json":
        return JsonFormatter(service)
    if fmt == "text":
        return logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
    raise ValueError(f"log format must be 'json' or 'text', not {fmt!r}")
