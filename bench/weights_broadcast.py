"""Broadcast weight transport bandwidth: `send_state_dict` against one plain `torch.distributed.broadcast`.

One sender (this process) and one receiver (a subprocess running this file with `--role receiver`), gloo
on loopback. For each size, repeat by repeat and interleaved, the sender:
- broadcasts the same number of bytes as one flat float32 tensor over a default process group that was
  set up once (the baseline: the best a single gloo broadcast does, with no group set-up);
- sends a state dict of that size (model-like tensors: 4 MiB and 12 MiB matrices with small vectors
  between them) with `send_state_dict`, which builds its own group per call, hand-shakes, sends large
  tensors as they are and small ones flattened into buckets: "total" includes the group's set-up and
  teardown, "buckets only" is the transfer alone.

The default group doubles as the control channel: before each measurement the sender broadcasts a small
command (which measurement, which size, which port) that the receiver follows. Times are the sender's.
The goal is `send_state_dict` total bandwidth >= 0.5 x the plain broadcast's.

Usage: python bench/weights_broadcast.py [--quick] [--repeats K] [--output-dir DIR] [--bucket-mib MIB ...]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from common import (
    Stats,
    base_parser,
    effective_repeats,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    report_results,
)
from common import ratio as safe_ratio

NAME = "weights_broadcast"
SIZES_MB = (25, 100)
QUICK_SIZES_MB = (2,)
HOST = "127.0.0.1"
STOP, PLAIN, OURS = 0, 1, 2
PATTERN = ((1024, 1024), (1024,), (3072, 1024), (1024,))
"""Shapes of one 'layer' of the synthetic state dict (float32): 4 MiB, 4 KiB, 12 MiB, 4 KiB."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def shapes_for(total_mb: int) -> list[tuple[int, ...]]:
    """Model-like float32 tensor shapes adding up to about `total_mb` MB (whole layers of PATTERN, or
    one shrunk matrix for sizes below a layer)."""
    target, shapes, size = total_mb * 1_000_000, [], 0
    while size < target:
        for shape in PATTERN:
            shapes.append(shape)
            size += 4 * _numel(shape)
    if len(shapes) == len(PATTERN) and size > 2 * target:
        shapes = [(target // 4096, 1024)]
    return shapes


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def state_dict_for(total_mb: int) -> dict[str, Any]:
    """A state dict of random float32 tensors shaped by `shapes_for`."""
    import torch

    gen = torch.Generator().manual_seed(total_mb)
    return {f"layer.{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes_for(total_mb))}


def metas_for(total_mb: int) -> list[Any]:
    from rlfabric.weights.broadcast import TensorMeta

    return [TensorMeta(f"layer.{i}", "float32", tuple(s)) for i, s in enumerate(shapes_for(total_mb))]


def command(op: int, size_mb: int = 0, port: int = 0, bucket_bytes: int = 0) -> list[int]:
    """Broadcasts (sender) or receives (receiver, pass zeros) one control command over the default group."""
    import torch
    import torch.distributed as dist

    cmd = torch.tensor([op, size_mb, port, bucket_bytes], dtype=torch.int64)
    dist.broadcast(cmd, src=0)
    return cmd.tolist()


def init_control(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )


# --- the receiver ----------------------------------------------------------------------------------------


def receiver(control_port: int) -> None:
    """Follows the sender's commands until STOP."""
    import torch
    import torch.distributed as dist

    from rlfabric.weights.broadcast import receive_state_dict

    init_control(1, control_port)
    while True:
        op, size_mb, port, bucket_bytes = command(STOP)
        if op == STOP:
            break
        if op == PLAIN:
            dist.broadcast(torch.empty(sum(_numel(s) for s in shapes_for(size_mb))), src=0)
        else:
            receive_state_dict(
                metas_for(size_mb), host=HOST, port=port, rank=1, world_size=2, bucket_bytes=bucket_bytes
            )
    dist.destroy_process_group()


# --- the sender ------------------------------------------------------------------------------------------


def measure_plain(size_mb: int, flat: Any) -> float:
    import torch.distributed as dist

    command(PLAIN, size_mb)
    start = time.perf_counter()
    dist.broadcast(flat, src=0)
    return time.perf_counter() - start


def measure_ours(size_mb: int, state_dict: dict[str, Any], bucket_bytes: int) -> tuple[float, float]:
    """(total seconds, transfer seconds) of one `send_state_dict`."""
    from rlfabric.weights.broadcast import send_state_dict

    port = free_port()
    command(OURS, size_mb, port, bucket_bytes)
    start = time.perf_counter()
    stats = send_state_dict(state_dict, host=HOST, port=port, world_size=2, bucket_bytes=bucket_bytes)
    return time.perf_counter() - start, stats.transfer_s


def bench_size(size_mb: int, repeats: int, buckets_mib: Sequence[int]) -> dict[str, Any]:
    """Interleaved repeats of the plain broadcast and `send_state_dict` at each bucket size (GB/s)."""
    import torch

    state_dict = state_dict_for(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    flat = torch.cat([t.reshape(-1) for t in state_dict.values()])
    plain: list[float] = []
    total: dict[int, list[float]] = {b: [] for b in buckets_mib}
    transfer: dict[int, list[float]] = {b: [] for b in buckets_mib}
    for _ in range(repeats):
        plain.append(nbytes / measure_plain(size_mb, flat) / 1e9)
        for bucket in buckets_mib:
            total_s, transfer_s = measure_ours(size_mb, state_dict, bucket << 20)
            total[bucket].append(nbytes / total_s / 1e9)
            transfer[bucket].append(nbytes / transfer_s / 1e9)
    baseline = Stats.of(plain, "GB/s")
    ours = {str(b): summarise(total[b], transfer[b], baseline.median) for b in buckets_mib}
    return {"bytes": nbytes, "tensors": len(state_dict), "plain_gbps": baseline.to_dict(), "ours": ours}


def summarise(total: list[float], transfer: list[float], baseline: float) -> dict[str, Any]:
    """One bucket size's bandwidths and their ratios to the plain broadcast's median."""
    total_stats, transfer_stats = Stats.of(total, "GB/s"), Stats.of(transfer, "GB/s")
    return {
        "total_gbps": total_stats.to_dict(),
        "transfer_gbps": transfer_stats.to_dict(),
        "ratio_total": safe_ratio(total_stats.median, baseline),
        "ratio_transfer": safe_ratio(transfer_stats.median, baseline),
    }


def start_receiver(control_port: int) -> subprocess.Popen:
    args = [sys.executable, __file__, "--role", "receiver", "--control-port", str(control_port)]
    return subprocess.Popen(args, start_new_session=True)


def sender(sizes_mb: Sequence[int], repeats: int, buckets_mib: Sequence[int]) -> dict[str, Any]:
    """Runs every size against one receiver subprocess, which it stops (by PID if it must)."""
    import torch.distributed as dist

    control_port = free_port()
    proc = start_receiver(control_port)
    try:
        init_control(0, control_port)
        results = {str(size): bench_size(size, repeats, buckets_mib) for size in sizes_mb}
        command(STOP)
        dist.destroy_process_group()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return results


# --- report ----------------------------------------------------------------------------------------------


def cell(stats: dict[str, Any]) -> str:
    return f"{fmt(stats['median'])} ({Stats(**stats).spread()})"


def render_markdown(payload: dict[str, Any]) -> str:
    headers = ["size (MB)", "tensors", "bucket (MiB)", "plain broadcast GB/s", "send_state_dict GB/s"]
    headers += ["ratio", "send_state_dict GB/s, buckets only", "ratio"]
    rows = []
    for size, r in payload["sizes"].items():
        for bucket, o in r["ours"].items():
            rows.append([
                size, r["tensors"], bucket, cell(r["plain_gbps"]), cell(o["total_gbps"]),
                fmt(o["ratio_total"]), cell(o["transfer_gbps"]), fmt(o["ratio_transfer"]),
            ])  # fmt: skip
    return "\n\n".join([
        "## weights_broadcast: broadcast weight transport (gloo, loopback, 1 receiver)",
        machine_line(payload["machine"]),
        f"Median of {payload['repeats']} interleaved repeats (min..max), bandwidth = payload bytes / sender "
        "seconds. `send_state_dict` includes building its group each call; \"buckets only\" excludes that. "
        "Goal: ratio >= 0.5.",
        markdown_table(headers, rows),
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(repeats=3)
    parser.add_argument(
        "--bucket-mib", type=int, nargs="+", default=[256], help="bucket sizes to try (default 256)"
    )
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--control-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "receiver":
        receiver(args.control_port)
        return 0
    repeats = effective_repeats(args)
    machine = machine_info()
    sizes = QUICK_SIZES_MB if args.quick else SIZES_MB
    results = sender(sizes, repeats, args.bucket_mib)
    payload = {"machine": machine, "repeats": repeats, "buckets_mib": args.bucket_mib, "sizes": results}
    markdown = render_markdown(payload)
    report_results(args.output_dir, NAME, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
