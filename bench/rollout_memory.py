"""Replica memory across weight versions: does a vLLM replica's memory stay flat while it loads version
after version in place?

    python bench/rollout_memory.py [--versions 200] [--hidden 256] [--layers 4] [--quick]
                                   [--output-dir bench/results]

A real `rlfabric serve rollout` process (vLLM on CPU, eager, the multiprocess engine as in production)
follows a run's object store. This script plays the learner: for each version it publishes a perturbed
copy of the model's weights (`rlfabric.weights.versions.publish_version`, older versions pruned), sends
`UpdateWeights` over gRPC with the learner's token, then asks for one small generation so the replica
serves each version. Every `--every` versions it records the resident (RSS) and proportional (PSS)
memory of each process of the replica's tree (the gRPC front end, vLLM's engine core and its worker).

Reported: the memory of the tree after the warm-up (first 10% of the versions) and at the end, and the
growth per version as the least-squares slope over the versions after the warm-up, per process and for
the tree. Goal (issue: secure by default and self-healing, point 6): flat, i.e. less than 0.1 MiB per
version for the tree. `--quick` loads 6 versions of a tiny model to prove the code path.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, fmt, machine_info, machine_line, markdown_table, report_results

NAME = "rollout_memory"
GOAL_MIB_PER_VERSION = 0.1
TOKEN = "bench-learner-token"
CLIENT_TOKEN = "bench-client-token"  # the replica's Generate token
MIB = 1 << 20


def vllm_env(scratch: Path) -> dict[str, str]:
    """vLLM on CPU as the tests start it: eager, loopback, scratch files under `scratch`."""
    return {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "TMPDIR": str(scratch),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "RLFABRIC_ROLLOUT__LEARNER_TOKEN": TOKEN,
        "RLFABRIC_ROLLOUT__CLIENT_TOKEN": CLIENT_TOKEN,
    }


def start_replica(model_dir: Path, weights_root: Path, scratch: Path) -> tuple[Any, str]:
    from rlfabric.local.procs import ServiceProcess

    command = [
        sys.executable, "-m", "rlfabric.cli", "serve", "rollout", "--model", str(model_dir), "--port", "0",
        "--set", "server.metrics_port=0",
        "--set", "engine.enforce_eager=true", "--set", "engine.kv_cache_bytes=268435456",
        "--set", "engine.max_model_len=256", "--set", f"weights_root={weights_root}",
        "--set", "log.format=text", "--set", "max_tokens=64",
    ]  # fmt: skip
    proc = ServiceProcess("rollout", command, log_path=scratch / "rollout.log", env=vllm_env(scratch))
    address = proc.start(r"listening on (\S+)", timeout_s=300).group(1)
    proc.wait_for(r"serving version", timeout_s=300)
    return proc, address


def tree_memory(pid: int) -> dict[str, dict[str, float]]:
    """RSS and PSS in MiB of `pid` and each descendant, keyed by a readable process name."""
    import psutil

    root = psutil.Process(pid)
    out: dict[str, dict[str, float]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
            name = "front end" if proc.pid == pid else proc.name()
        except psutil.NoSuchProcess:
            continue
        key = name if name not in out else f"{name} ({proc.pid})"
        out[key] = {"rss": info.rss / MIB, "pss": info.pss / MIB}
    out["tree"] = {m: sum(p[m] for p in out.values()) for m in ("rss", "pss")}
    return out


def perturbed(base: dict[str, Any], version: int) -> dict[str, Any]:
    """The base weights plus a small version-seeded perturbation (a new tensor each version)."""
    import torch

    generator = torch.Generator().manual_seed(version)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in base.items()}


def load_versions(address: str, pid: int, model_dir: Path, root: Path, args: Any) -> list[dict[str, Any]]:
    """Publish, update and generate for each version; memory samples every `args.every` versions."""
    import grpc
    from safetensors.torch import load_file
    from tqdm import tqdm

    from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
    from rlfabric.weights import versions as store

    base = load_file(str(next(model_dir.glob("*.safetensors"))))
    samples = [{"version": 0, "memory": tree_memory(pid)}]
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for version in tqdm(range(1, args.versions + 1), desc="versions", unit="v"):
            store.publish_version(root, version, perturbed(base, version))
            store.prune(root, keep=2)
            update = rollout_pb2.UpdateWeightsRequest(
                version=version, object_store=rollout_pb2.ObjectStoreSource(root_url=str(root))
            )
            stub.UpdateWeights(update, metadata=auth, timeout=120)
            request = rollout_pb2.GenerateRequest(
                request_id=f"v{version}",
                prompts=[rollout_pb2.GeneratePrompt(prompt_id="p", prompt=common_pb2.Prompt(text="abc"))],
                sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8),
            )
            client = (("authorization", f"Bearer {CLIENT_TOKEN}"),)
            got = list(stub.Generate(request, timeout=120, metadata=client))
            assert {s.policy_version for s in got} == {version}, "the replica did not serve the new version"
            if version % args.every == 0 or version == args.versions:
                samples.append({"version": version, "memory": tree_memory(pid)})
    return samples


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two points)."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def summarise(samples: list[dict[str, Any]], versions: int) -> dict[str, Any]:
    """Per process: MiB after the warm-up, at the end, and the slope in MiB per version (RSS and PSS)."""
    warm = max(1, versions // 10)
    after = [s for s in samples if s["version"] >= warm]
    names = [n for n in after[-1]["memory"] if all(n in s["memory"] for s in after)]
    rows: dict[str, Any] = {}
    for name in names:
        rows[name] = {
            metric: {
                "after_warmup_mib": after[0]["memory"][name][metric],
                "end_mib": after[-1]["memory"][name][metric],
                "mib_per_version": slope([(s["version"], s["memory"][name][metric]) for s in after]),
            }
            for metric in ("rss", "pss")
        }
    return {"warmup_versions": warm, "processes": rows}


def markdown(payload: dict[str, Any]) -> str:
    summary = payload["summary"]
    rows = [
        [
            name,
            fmt(m["rss"]["after_warmup_mib"]),
            fmt(m["rss"]["end_mib"]),
            f"{m['rss']['mib_per_version']:+.3f}",
            fmt(m["pss"]["end_mib"]),
            f"{m['pss']['mib_per_version']:+.3f}",
        ]
        for name, m in summary["processes"].items()
    ]
    headers = ["process", "RSS after warm-up (MiB)", "RSS at end", "RSS MiB/version", "PSS at end",
               "PSS MiB/version"]  # fmt: skip
    tree = summary["processes"]["tree"]["pss"]["mib_per_version"]
    verdict = "met" if payload["goal_met"] else "NOT met"
    return "\n".join(
        [
            f"## {NAME}: replica memory over {payload['versions']} weight versions",
            "",
            machine_line(payload["machine"]),
            f"Model: {payload['model']['parameters'] / 1e6:.2f} M parameters "
            f"({payload['model']['bytes'] / MIB:.1f} MiB of weights); slopes after the first "
            f"{summary['warmup_versions']} versions; {payload['seconds']:.0f} s in all.",
            "",
            markdown_table(headers, rows),
            "",
            f"Goal: the tree's PSS grows < {GOAL_MIB_PER_VERSION} MiB per version: {verdict} "
            f"({tree:+.3f} MiB/version).",
        ]
    )


def plot(payload: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    samples = payload["samples"]
    for name in payload["summary"]["processes"]:
        points = [(s["version"], s["memory"][name]["pss"]) for s in samples if name in s["memory"]]
        ax.plot([x for x, _ in points], [y for _, y in points], marker=".", label=name)
    ax.set_xlabel("weight version loaded")
    ax.set_ylabel("PSS (MiB)")
    ax.set_title("Replica memory across in-place weight updates")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=200, help="versions to load (default %(default)s)")
    parser.add_argument("--every", type=int, default=10, help="memory sample interval (versions)")
    parser.add_argument("--hidden", type=int, default=256, help="tiny model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="tiny model depth (default %(default)s)")
    args = parser.parse_args()
    if args.quick:
        args.versions, args.every, args.hidden, args.layers = 6, 2, 128, 2
    from rlfabric.tools.tiny_model import make_tiny_model

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlfabric-bench-memory-") as tmp:
        scratch = Path(tmp)
        model_dir = make_tiny_model(scratch / "model", hidden=args.hidden, layers=args.layers)
        root = scratch / "weights"
        root.mkdir()
        proc, address = start_replica(model_dir, root, scratch)
        try:
            samples = load_versions(address, proc.pid, model_dir, root, args)
        finally:
            proc.stop(grace_s=30)
        weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    summary = summarise(samples, args.versions)
    payload = {
        "name": NAME,
        "quick": args.quick,
        "machine": machine_info(),
        "versions": args.versions,
        "model": {"hidden": args.hidden, "layers": args.layers, "bytes": weights, "parameters": weights // 4},
        "samples": samples,
        "summary": summary,
        "goal_met": summary["processes"]["tree"]["pss"]["mib_per_version"] < GOAL_MIB_PER_VERSION,
        "seconds": time.monotonic() - started,
    }
    report_results(args.output_dir, NAME, payload, markdown(payload), plot)


if __name__ == "__main__":
    main()
