"""A process's peak RSS is its own: a child started by a large parent does not report the parent's peak
(which `ru_maxrss` does on Linux, across fork and exec)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from rlfabric.runtime.memory import peak_rss_bytes

PARENT_BYTES = 400 * 2**20
CHILD = (
    "import json, resource; from rlfabric.runtime.memory import peak_rss_bytes; "
    "print(json.dumps([peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))"
)


def test_a_child_of_a_large_parent_reports_its_own_peak() -> None:
    held = bytearray(PARENT_BYTES)
    for i in range(0, len(held), 4096):  # touch every page: resident in this process
        held[i] = 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > PARENT_BYTES
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    own, inherited = json.loads(out)
    assert own < PARENT_BYTES / 2, own  # a Python interpreter importing one module: tens of MB
    if sys.platform.startswith("linux"):
        assert inherited > PARENT_BYTES  # what ru_maxrss says on Linux: the reason for VmHWM
    del held


def test_the_peak_grows_with_what_this_process_touches() -> None:
    before = peak_rss_bytes()
    block = bytearray(64 * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    assert peak_rss_bytes() >= before
    assert peak_rss_bytes() >= 64 * 2**20
