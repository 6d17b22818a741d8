"""Shared helpers of the benchmark scripts in `bench/`: repeats and their spread, machine facts, results.

Every benchmark measures its baseline in the same run as the thing it compares (ideally interleaved,
repeat by repeat), because this kind of machine is noisy: a ratio against a number from another day
means little. A benchmark writes `<output-dir>/<name>.json` (everything, raw repeats included),
`<name>.md` (the table people read) and, where a picture helps, `<name>.png`.

`--quick` runs tiny sizes with one repeat: it exists so CI exercises every code path of a benchmark in
seconds; its figures are not meant to be read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rlfabric.runtime.hardware import cpu_description

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUTPUT_DIR = BENCH_DIR / "results"


@dataclass(frozen=True)
class Stats:
    """Summary of k repeats of one measurement: median and spread (min/max and the quartiles)."""

    unit: str
    median: float
    min: float
    max: float
    q1: float
    q3: float
    values: list[float]

    @classmethod
    def of(cls, values: Sequence[float], unit: str) -> Stats:
        data = sorted(float(v) for v in values)
        if not data:
            raise ValueError("no values to summarise")
        q1, q3 = quartiles(data)
        return cls(unit, statistics.median(data), data[0], data[-1], q1, q3, list(values))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def spread(self) -> str:
        """The min..max range, for a table cell."""
        return f"{fmt(self.min)}..{fmt(self.max)}"


def quartiles(data: Sequence[float]) -> tuple[float, float]:
    """First and third quartiles (both equal to the value when there is only one)."""
    if len(data) < 2:
        return data[0], data[0]
    q = statistics.quantiles(data, n=4, method="inclusive")
    return q[0], q[2]


def percentile(values: Sequence[float], pct: float) -> float:
    """The `pct` percentile (0-100) by linear interpolation; used for per-call latencies."""
    data = sorted(values)
    if not data:
        return float("nan")
    rank = (len(data) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def repeat(measure: Callable[[], float], k: int, unit: str) -> Stats:
    """Runs `measure` `k` times and summarises what it returned."""
    return Stats.of([measure() for _ in range(k)], unit)


def ratio(value: float, baseline: float) -> float:
    """`value / baseline`, NaN when the baseline is not positive."""
    return value / baseline if baseline > 0 else float("nan")


def fmt(value: float) -> str:
    """A number for a table: thousands separated, two decimals below 10."""
    if value != value:  # NaN
        return "n/a"
    if abs(value) < 10:
        return f"{value:.2f}"
    return f"{value:,.0f}"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (torch is reported when installed, never required)."""
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_description(),
        "packages": {name: package_version(name) for name in ("grpcio", "protobuf", "math-verify", "torch")},
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def base_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: --quick, --repeats, --output-dir."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (CI smoke run)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="repeats per measurement (default %(default)s)"
    )
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, help="where results go")
    return parser


def effective_repeats(args: argparse.Namespace) -> int:
    return 1 if args.quick else max(1, args.repeats)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; cells are written with `str`."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    """One line describing the machine, for the top of a markdown report."""
    packages = ", ".join(f"{k} {v}" for k, v in machine["packages"].items() if v)
    cpu = machine.get("cpu") or {}
    features = ", ".join(cpu.get("features", [])) or "no AVX2/AVX-512/AMX"
    if "bfloat16_speedup" in cpu:
        features += f"; bfloat16 matmul {cpu['bfloat16_speedup']:.2f}x float32"
    return (
        f"{machine['cpu_count']} CPUs: {cpu.get('model', machine.get('processor'))} ({features}; "
        f"load {machine['load_avg_1m']:.2f} at start), "
        f"Python {machine['python']}, {machine['platform']}; {packages}"
    )


def write_results(output_dir: Path, name: str, payload: dict[str, Any], markdown: str) -> dict[str, Path]:
    """Writes `<name>.json` and `<name>.md` under `output_dir`; returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / f"{name}.json", "md": output_dir / f"{name}.md"}
    paths["json"].write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    paths["md"].write_text(markdown.rstrip() + "\n")
    return paths


def report_results(
    output_dir: Path,
    name: str,
    payload: dict[str, Any],
    markdown: str,
    plot: Callable[[dict[str, Any], Path], Path | None] | None = None,
) -> None:
    """A benchmark's ending: `<name>.json` and `<name>.md`, the plot `plot(payload, <name>.png)` when
    given, then the markdown and the files written, on stdout."""
    paths = write_results(output_dir, name, payload, markdown)
    image = plot(payload, output_dir / f"{name}.png") if plot is not None else None
    print(markdown)
    print(f"\nwrote {paths['json']}, {paths['md']}" + (f", {image}" if image else ""))


@dataclass(frozen=True)
class Bar:
    """One bar of a bar plot: its median and its min/max whiskers."""

    label: str
    stats: Stats


def bar_plot(
    path: Path,
    panels: Sequence[tuple[str, str, Sequence[Bar]]],
    title: str,
    goals: Sequence[float | None] | None = None,
) -> Path | None:
    """Side-by-side bar panels (title, y label, bars) with min/max whiskers, and a dashed line at each
    panel's goal where `goals` gives one; None if matplotlib is missing (the JSON and markdown are the
    results, the picture is a convenience)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (panel_title, ylabel, bars), goal in zip(
        axes[0], panels, goals or [None] * len(panels), strict=True
    ):
        draw_bars(ax, bars)
        if goal is not None:
            ax.axhline(goal, color="#c44e52", linestyle="--", linewidth=1, label=f"goal {fmt(goal)}")
            ax.legend(loc="upper right", fontsize=8)
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_bars(ax: Any, bars: Sequence[Bar]) -> None:
    medians = [b.stats.median for b in bars]
    errors = [
        [m - b.stats.min for m, b in zip(medians, bars, strict=True)],
        [b.stats.max - m for m, b in zip(medians, bars, strict=True)],
    ]
    ax.bar(range(len(bars)), medians, yerr=errors, capsize=4, color="#4c72b0")
    ax.set_xticks(range(len(bars)), [b.label for b in bars], rotation=15, ha="right")
    for x, m in enumerate(medians):
        ax.annotate(
            fmt(m), (x, m), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points"
        )


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (Linux /proc); None elsewhere or once gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": fields[11], [12] are utime, stime
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_times() -> tuple[float, float] | None:
    """(stolen, total) CPU seconds of the whole machine so far, every CPU summed (Linux /proc/stat);
    None elsewhere. "Stolen" is the time a virtual machine's CPUs were ready to run but the hypervisor
    ran something else: on a shared host it slows every process here, and the more so one whose threads
    wait for each other (OpenMP)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK")
    return ticks[7] / hz, sum(ticks) / hz


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc); empty elsewhere."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far by this process, a service process and the service's children."""

    wall: float
    client: float
    server: float
    children: float

    @classmethod
    def take(cls, server_pid: int) -> CpuSnapshot:
        kids = [cpu_seconds(pid) for pid in child_pids(server_pid)]
        return cls(
            time.perf_counter(),
            time.process_time(),
            cpu_seconds(server_pid) or 0.0,
            sum(k for k in kids if k is not None),
        )

    def used_since(self, before: CpuSnapshot) -> dict[str, float]:
        """Wall seconds, and CPU seconds each side used, between `before` and this snapshot."""
        return {
            "wall": self.wall - before.wall,
            "client": self.client - before.client,
            "server": self.server - before.server,
            "workers": self.children - before.children,
        }
