"""This process's peak resident memory, measured so that a parent's memory never counts.

`getrusage(RUSAGE_SELF).ru_maxrss` is the wrong reading for a process started by another: Linux carries
the larger of the parent's and the child's high-water marks across fork and exec (the kernel keeps the old
address space's peak in the process's `maxrss` at exec), so a learner started by a 1.3 GB test runner
reports at least 1.3 GB however little it uses. `VmHWM` in /proc/self/status is the high-water mark of the
current address space only, which starts at exec. It is read where it exists (Linux), else `ru_maxrss`.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

STATUS = Path("/proc/self/status")


def peak_rss_bytes() -> int:
    """The peak resident set of this process image so far, in bytes (`VmHWM`; `ru_maxrss` without /proc)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
