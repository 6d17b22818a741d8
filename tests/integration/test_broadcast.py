"""The broadcast weight transport: bucket planning, torch-only transfers between processes over gloo on
loopback (bitwise equality, timeouts, refusals), and a transfer into a real vLLM engine whose greedy
log-probabilities then match a transformers forward pass of the new weights."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.contracts import wire
from rlfabric.weights.broadcast import (
    BroadcastError,
    BroadcastTimeout,
    TensorMeta,
    metas_from_json,
    metas_from_state_dict,
    metas_to_json,
    mismatches,
    plan_buckets,
    receive_state_dict,
    send_state_dict,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


VLLM_HELPER = Path(__file__).with_name("_broadcast_vllm_receiver.py")
HOST = "127.0.0.1"
SLACK_S = 3.0
"""Allowed lateness of a timeout: one store retry delay plus process noise on a busy 2-core machine."""

RECEIVER = """
import json, sys, torch
from rlfabric.weights.broadcast import BroadcastError, metas_from_json, receive_state_dict
spec = json.loads(sys.argv[1])
open(spec["out"] + ".ready", "w").close()
try:
    received, stats = receive_state_dict(
        metas_from_json(spec["metas"]), host="127.0.0.1", port=spec["port"], rank=spec["rank"],
        world_size=spec["world_size"], bucket_bytes=spec["bucket_bytes"], timeout_s=spec["timeout_s"],
    )
except BroadcastError as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
    sys.exit(3)
torch.save({k: v.clone() for k, v in received.items()}, spec["out"])
print(json.dumps(stats.to_dict()))
"""
"""A torch-only receiver process: argv[1] is a JSON spec; prints its stats (or its error) as JSON."""


def mixed_state_dict() -> dict[str, torch.Tensor]:
    """fp32 and bf16 tensors, interleaved, one larger than a 64 KiB bucket, a 0-d one and an empty one."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (7,), (300, 100), (), (3, 5, 2), (0, 4), (16, 1000), (33,)]
    return {
        f"t{i}": torch.randn(shape, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
        for i, shape in enumerate(shapes)
    }


def start_receiver(tmp_path: Path, rank: int, world_size: int, port: int, **spec: Any) -> subprocess.Popen:
    spec = {
        "rank": rank,
        "world_size": world_size,
        "port": port,
        "out": str(tmp_path / f"r{rank}.pt"),
        **spec,
    }
    return subprocess.Popen(
        [sys.executable, "-c", RECEIVER, json.dumps(spec)], stdout=subprocess.PIPE, start_new_session=True
    )


def wait_ready(proc: subprocess.Popen, ready: Path, timeout: float = 60) -> None:
    """Waits until a receiver has imported torch (slow on a loaded machine) and is about to join."""
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "receiver died or never got ready"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    """Waits for a receiver (killing its process group by PID on timeout); its exit code and JSON line."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"receiver {proc.pid} did not finish in {timeout} s")
    return proc.returncode, json.loads(out.decode().strip().splitlines()[-1])


# --- planning and metadata -------------------------------------------------------------------------------


def test_plan_buckets_groups_dtypes_and_bounds_size() -> None:
    metas = metas_from_state_dict(mixed_state_dict())
    assert [m.dtype for m in metas] == ["float32"] * 4 + ["bfloat16"] * 4  # broadcast order: by dtype
    buckets = plan_buckets(metas, 64 << 10)
    # t2 (120 KB) exceeds a bucket and travels alone; t6 (64,000 B) no longer fits beside t0 and t4.
    assert [[m.name for m in b] for b in buckets] == [["t2"], ["t0", "t4"], ["t6"], ["t1", "t3", "t5", "t7"]]
    for bucket in buckets:
        assert len({m.dtype for m in bucket}) == 1
        assert len(bucket) == 1 or sum(m.nbytes for m in bucket) <= 64 << 10
    assert plan_buckets(metas, 1 << 30) == [metas[:4], metas[4:]]  # all below SOLO_BYTES: one per dtype
    assert plan_buckets(metas, 1 << 30, solo_bytes=8192)[:2] == [[metas[0]], [metas[1]]]


def test_metas_round_trip_through_proto_and_json() -> None:
    metas = metas_from_state_dict(mixed_state_dict())
    assert wire.metas_from_proto(wire.metas_to_proto(metas)) == metas
    assert metas_from_json(metas_to_json(metas)) == metas
    assert metas_from_json(json.dumps(metas_to_json(metas))) == metas


def test_mismatches_names_every_problem() -> None:
    expected = {"a": (2, 3), "b": (4,)}
    assert mismatches([TensorMeta("a", "float32", (2, 3)), TensorMeta("b", "bfloat16", (4,))], expected) == []
    problems = mismatches([TensorMeta("a", "float32", (3, 2)), TensorMeta("c", "float32", (1,))], expected)
    assert problems == ["a: shape (3, 2), model has (2, 3)", "c: not a tensor of this model", "b: missing"]


# --- torch-only transfers between processes ----------------------------------------------------------------


def test_two_receivers_get_bitwise_equal_tensors(tmp_path: Path) -> None:
    state_dict, port = mixed_state_dict(), free_port()
    spec = {
        "metas": metas_to_json(metas_from_state_dict(state_dict)),
        "bucket_bytes": 64 << 10,
        "timeout_s": 60,
    }
    procs = [start_receiver(tmp_path, rank, 3, port, **spec) for rank in (1, 2)]
    stats = send_state_dict(
        state_dict, host=HOST, port=port, world_size=3, bucket_bytes=64 << 10, timeout_s=60
    )
    assert stats.tensors == len(state_dict) and stats.buckets > 2
    assert stats.bytes == sum(t.numel() * t.element_size() for t in state_dict.values())
    for rank, proc in zip((1, 2), procs, strict=True):
        code, receiver_stats = finish(proc)
        assert code == 0 and receiver_stats["buckets"] == stats.buckets
        received = torch.load(tmp_path / f"r{rank}.pt")
        assert list(received) == [m["name"] for m in spec["metas"]]
        for name, tensor in state_dict.items():
            got = received[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(got.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))


def test_sender_fails_when_a_receiver_never_joins(tmp_path: Path) -> None:
    state_dict, port, timeout_s = mixed_state_dict(), free_port(), 4.0
    spec = {
        "metas": metas_to_json(metas_from_state_dict(state_dict)),
        "bucket_bytes": 1 << 20,
        "timeout_s": 30,
    }
    joined = start_receiver(tmp_path, 1, 3, port, **spec)  # rank 2 never comes
    wait_ready(joined, tmp_path / "r1.pt.ready")
    start = time.monotonic()
    with pytest.raises(BroadcastTimeout, match=r"ranks \[2\] did not join"):
        send_state_dict(
            state_dict, host=HOST, port=port, world_size=3, bucket_bytes=1 << 20, timeout_s=timeout_s
        )
    assert time.monotonic() - start < timeout_s + SLACK_S
    code, result = finish(joined)
    assert code == 3 and result["error"] in ("BroadcastTimeout", "BroadcastError")


def test_receiver_fails_when_the_sender_never_comes() -> None:
    meta, timeout_s = TensorMeta("a", "float32", (4,)), 3.0
    start = time.monotonic()
    with pytest.raises(BroadcastTimeout):
        receive_state_dict([meta], host=HOST, port=free_port(), rank=1, world_size=2, timeout_s=timeout_s)
    assert time.monotonic() - start < timeout_s + SLACK_S


def test_plan_mismatch_fails_both_sides_before_any_transfer(tmp_path: Path) -> None:
    state_dict, port = mixed_state_dict(), free_port()
    spec = {
        "metas": metas_to_json(metas_from_state_dict(state_dict)),
        "bucket_bytes": 1 << 10,
        "timeout_s": 30,
    }
    proc = start_receiver(tmp_path, 1, 2, port, **spec)
    start = time.monotonic()
    with pytest.raises(BroadcastError, match="refused"):
        send_state_dict(state_dict, host=HOST, port=port, world_size=2, bucket_bytes=1 << 20, timeout_s=30)
    assert time.monotonic() - start < 25  # refused at the handshake, not timed out
    code, result = finish(proc)
    assert code == 3 and "refused" in result["message"]


# --- into a real vLLM engine -----------------------------------------------------------------------------


def run_vllm_receiver(
    model_dir: Path,
    tmp_path: Path,
    env: dict[str, str],
    sends: list[dict[str, torch.Tensor]],
    prompts: list[str],
) -> tuple[list[Any], dict[str, Any]]:
    """Starts the vLLM helper, plays the learner for each state dict of `sends`, returns (outcomes, report).

    An outcome is the sender's BroadcastStats, or the BroadcastError it raised."""
    specs = []
    for i, state_dict in enumerate(sends):
        spec = {"metas": metas_to_json(metas_from_state_dict(state_dict)), "port": free_port()}
        specs.append(tmp_path / f"transfer{i}.json")
        specs[-1].write_text(json.dumps({**spec, "bucket_bytes": 1 << 20, "timeout_s": 60}))
    args = [sys.executable, str(VLLM_HELPER), str(model_dir), "--out", str(tmp_path / "out.json")]
    args += ["--ready", str(tmp_path / "ready"), *(f"--transfer={s}" for s in specs)]
    args += [f"--prompt={p}" for p in prompts]
    log = (tmp_path / "vllm.log").open("wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        outcomes = [
            send_to_engine(proc, s, json.loads(p.read_text())["port"])
            for s, p in zip(sends, specs, strict=True)
        ]
        assert proc.wait(timeout=120) == 0, (tmp_path / "vllm.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    return outcomes, json.loads((tmp_path / "out.json").read_text())


def send_to_engine(proc: subprocess.Popen, state_dict: dict[str, torch.Tensor], port: int) -> Any:
    """Sends once the engine is up (its ready file exists); returns the stats or the BroadcastError."""
    ready = Path(proc.args[proc.args.index("--ready") + 1])
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "vLLM helper died or never got ready"
        time.sleep(0.2)
    try:
        return send_state_dict(
            state_dict, host=HOST, port=port, world_size=2, bucket_bytes=1 << 20, timeout_s=60
        )
    except BroadcastError as error:
        return error


def hf_logprobs(model: Any, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities over the vocabulary at each completion position, by one forward pass. (T, V)"""
    ids = torch.tensor([prompt_ids + token_ids])  # (1, P + T)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]  # (T, V)
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.vllm
def test_broadcast_into_vllm_serves_the_new_weights(
    tiny_model_dir: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from rlfabric.tools.tiny_model import make_tiny_model

    new_dir = make_tiny_model(tmp_path / "new-model", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    good = {k: v.detach().clone() for k, v in new_model.state_dict().items()}
    bad = {**good, "model.norm.weight": torch.ones(7)}  # wrong shape: the worker must refuse it
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    prompts = ["Hello, world", "a b\nc"]
    outcomes, report = run_vllm_receiver(tiny_model_dir, tmp_path, env, [bad, good], prompts)

    assert isinstance(outcomes[0], BroadcastError) and "model.norm.weight" in str(outcomes[0])
    assert not report["transfers"][0]["ok"]
    assert outcomes[1].tensors == len(good) and report["transfers"][1]["ok"]
    for result in report["greedy"]:
        logprobs = hf_logprobs(new_model, result["prompt_token_ids"], result["token_ids"])  # (T, V)
        assert logprobs.argmax(dim=-1).tolist() == result["token_ids"]
        expected = logprobs.gather(1, torch.tensor(result["token_ids"])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result["logprobs"]), expected, atol=1e-4, rtol=0)


def test_bench_quick(tmp_path: Path) -> None:
    """`bench/weights_broadcast.py --quick` runs every code path of the benchmark and writes its results."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "weights_broadcast.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--quick", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "weights_broadcast.json").read_text())
    assert (tmp_path / "weights_broadcast.md").read_text().startswith("## weights_broadcast")
    (size,) = result["sizes"].values()
    assert size["plain_gbps"]["median"] > 0
    assert size["ours"]["256"]["total_gbps"]["median"] > 0 and size["ours"]["256"]["ratio_total"] > 0
