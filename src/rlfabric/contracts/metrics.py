"""The run's metrics stream (`keys.metrics`): the learner's one row per step, read by the coordinator's API
and health checks and by the ledger.

Each entry has one field, `row`: a JSON object with at least `step` and `policy_version` (a restart marker
row also has an `event`, see `lineage.restart_row`). `append_row` is the only writer.

Imports without torch or grpc (the coordinator and the ledger use it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlfabric.contracts import keys

ROW_FIELD = "row"
"""The entry field holding the row's JSON."""


async def append_row(redis: Any, run_id: str, row: Mapping[str, Any]) -> str:
    """Appends one metrics row (an async client); returns its stream id as text."""
    entry_id = await redis.xadd(keys.metrics(run_id), {ROW_FIELD: json.dumps(dict(row))})
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def row_text(fields: Mapping[Any, Any]) -> str:
    """The JSON text of an entry's row, from a bytes or a decoding client's reply ("{}" without one)."""
    value = fields.get(ROW_FIELD.encode(), fields.get(ROW_FIELD, "{}"))
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_row(fields: Mapping[Any, Any]) -> dict[str, Any]:
    """An entry's row as a dict."""
    return dict(json.loads(row_text(fields)))
