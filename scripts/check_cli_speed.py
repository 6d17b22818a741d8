"""Checks that `rlfabric --help` and every `rlfabric serve X --help` answer within 2 seconds.

The CLI is built to import only argparse and pydantic before it knows which command runs; this check
keeps it that way. It prints each time and fails if any is over the limit (best of 3 runs, to ride out
a noisy machine).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

LIMIT_S = 2.0
SERVICES = ("coordinator", "rollout", "reward", "learner", "environment")
COMMANDS = [["--help"], *(["serve", name, "--help"] for name in SERVICES)]


def best_time(args: list[str]) -> float:
    exe = shutil.which("rlfabric") or sys.exit("rlfabric is not on PATH")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([exe, *args], check=True, capture_output=True, timeout=30)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    slow = []
    for args in COMMANDS:
        seconds = best_time(args)
        print(f"  rlfabric {' '.join(args):<28} {seconds:.2f} s")
        if seconds > LIMIT_S:
            slow.append(" ".join(args))
    if slow:
        print(f"over {LIMIT_S} s: {slow}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
