"""Soak of the demo loop: `rlfabric up` for a bounded number of steps (and wall-clock seconds), sampled
every few seconds; writes what it saw and prints a summary.

    python loadtest/soak.py --steps 200 --max-seconds 1800 --out soak-out

Recorded: throughput (learner steps/s, trained tokens/s from metrics.jsonl, samples generated from the
run's counters over the time between the first and the last learner step), learner step latency p50/p99
(time between consecutive metrics rows), error rate ((scorer errors + re-dispatches) / samples generated,
from the coordinator's counters), and the resident memory of every service process over time
(`memory.csv`: seconds, process, RSS MiB). Loopback only: `up`
starts everything on 127.0.0.1. Stops `up` with SIGTERM (by PID) at the step budget or the time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants (vLLM engine workers), in MiB."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        stack += [int(c) for c in children]
    return total / 1024


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-seconds", type=float, default=1800)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "rlfabric.cli", "up", "--run-dir", str(args.out / "run")]
    argv += ["--steps", str(args.steps), "--no-progress"]
    log = (args.out / "up.log").open("w")
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert up.stdout is not None
    output = UpOutput(up.stdout, log)
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    stop_sent = False
    with (args.out / "memory.csv").open("w", newline="") as f:
        memory = csv.writer(f)
        memory.writerow(["seconds", "process", "rss_mib"])
        next_sample = time.monotonic()
        while up.poll() is None:
            output.poll()
            elapsed = time.monotonic() - started
            if elapsed > args.max_seconds and not stop_sent:
                # Once: `up` stops the run, then every process; a second SIGTERM would interrupt that.
                up.send_signal(signal.SIGTERM)
                stop_sent = True
            if time.monotonic() >= next_sample:
                next_sample += args.interval
                for name, pid in output.pids.items():
                    memory.writerow([round(elapsed, 1), name, round(rss_mib(pid), 1)])
                f.flush()
                if output.url:
                    samples.append({"seconds": elapsed, **counters(output.url)})
            time.sleep(0.2)
    output.poll()
    log.write(output.partial)
    log.close()
    summary = summarize(args.out, samples, time.monotonic() - started, up.returncode)
    summary["stopped_at_time_limit"] = stop_sent
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if up.returncode == 0 else 1


class UpOutput:
    """`up`'s output, read without blocking and handled in whole lines, copied to up.log: the pid of each
    process ("x ready (pid n, t s)") and the run page's URL."""

    def __init__(self, stream: IO[bytes], log: IO[str]) -> None:
        self.fd, self.log = stream.fileno(), log
        os.set_blocking(self.fd, False)
        self.partial = ""
        self.pids: dict[str, int] = {}
        self.url = ""

    def poll(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.fd, 65536):
                self.partial += chunk.decode(errors="replace")
        *lines, self.partial = self.partial.split("\n")
        for line in lines:
            self.log.write(line + "\n")
            if m := re.search(r"^\s*(\S+) ready \(pid (\d+)", line):
                self.pids[m[1]] = int(m[2])
            if m := re.search(r"page: (http://\S+)/runs/", line):
                self.url = m[1]
        self.log.flush()


def counters(url: str) -> dict[str, Any]:
    try:
        return dict(httpx.get(f"{url}/v1/runs/demo", timeout=5).json().get("counters") or {})
    except (httpx.HTTPError, ValueError):
        return {}


def summarize(out: Path, samples: list[dict[str, Any]], seconds: float, code: int | None) -> dict[str, Any]:
    metrics = out / "run" / "demo" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(rows)]
    # The newest sample that read the counters (the last ones may come after the coordinator stopped).
    last = next((c for c in reversed(samples) if "samples_generated" in c), {})
    generated = int(last.get("samples_generated", 0))
    errors = int(last.get("scorer_errors", 0)) + int(last.get("redispatches", 0))
    span = rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else float("nan")
    peak: dict[str, float] = {}
    with (out / "memory.csv").open() as f:
        for row in csv.DictReader(f):
            peak[row["process"]] = max(peak.get(row["process"], 0.0), float(row["rss_mib"]))
    return {
        "exit_code": code,
        "wall_seconds": round(seconds, 1),
        "steps": len(rows),
        "steps_per_s": round((len(rows) - 1) / span, 4) if len(rows) > 1 else None,
        "trained_tokens_per_s_mean": round(statistics.mean(r.get("tokens_per_s", 0) for r in rows), 1)
        if rows
        else None,
        "samples_generated": generated,
        "samples_per_s": round(generated / span, 2) if len(rows) > 1 else None,
        "step_latency_p50_s": round(percentile(gaps, 0.5), 3),
        "step_latency_p99_s": round(percentile(gaps, 0.99), 3),
        "error_rate": round(errors / generated, 5) if generated else None,
        "peak_rss_mib": peak,
        "final_reward_mean": rows[-1].get("reward_mean") if rows else None,
    }


if __name__ == "__main__":
    sys.exit(main())
