"""asyncio helpers the services share."""

from __future__ import annotations

import asyncio


def cancel_point() -> None:
    """Raises CancelledError when the current task is being cancelled.

    Called at the top of every long-running loop: Python 3.11's `asyncio.wait_for`, which libraries use
    inside their calls (redis-py's `send_packed_command`), can swallow a cancellation that arrives as
    its inner await finishes; the task's `cancelling()` count still says it was asked to stop, and a loop
    that checks it ends instead of running on forever (seen: a coordinator whose runs never finished
    cancelling at shutdown)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
