"""FSDP2 under torchrun with gloo: 2 ranks train like 1 rank, and a checkpoint round trip resumes exactly
(full weights, PPO's critic, LoRA adapters).

The world of one runs as a plain process (the learner's no-torchrun path), concurrently with the
torchrun world of two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_train_worker.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 120


def start_worker(nproc: int, model_dir: Path, out: Path, advantage: str = "grpo") -> subprocess.Popen[bytes]:
    """Start the worker: under torchrun for 2 ranks, as a plain process (a world of one) for 1.

    Loopback only; the worker leads its own process group so a timeout can kill all of it."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    launcher = [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc)]
    if nproc == 1:
        launcher = [sys.executable]
        env.pop("MASTER_ADDR")
    cmd = [*launcher, str(WORKER), str(model_dir), str(out), advantage]
    with open(out / "worker.log", "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_worker(proc: subprocess.Popen[bytes], out: Path, deadline: float) -> None:
    """Wait for the worker until `deadline` (monotonic); on timeout kill the group of the PID we started."""
    try:
        rc = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert rc == 0, (out / "worker.log").read_text()[-4000:]


def run_worlds(model_dir: Path, root: Path, advantage: str = "grpo") -> dict[int, Path]:
    """The worker's output folder for world sizes 1 and 2, run concurrently."""
    outs = {nproc: root / f"world{nproc}" for nproc in (1, 2)}
    procs = {nproc: start_worker(nproc, model_dir, out, advantage) for nproc, out in outs.items()}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for nproc, proc in procs.items():
            wait_worker(proc, outs[nproc], deadline)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outs


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    return run_worlds(tiny_model_dir, tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    return run_worlds(tiny_model_dir, tmp_path_factory.mktemp("fsdp-lora"), advantage="lora")


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _assert_same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], atol: float) -> None:
    assert left.keys() == right.keys()
    for name, tensor in left.items():
        torch.testing.assert_close(right[name], tensor, atol=atol, rtol=0, msg=name)


def test_two_ranks_train_like_one(runs: dict[int, Path], tiny_model_dir: Path) -> None:
    one, two = (json.loads((runs[n] / "metrics.json").read_text()) for n in (1, 2))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for m1, m2 in zip(one["a"], two["a"], strict=True):
        assert m2 == pytest.approx(m1, abs=1e-5)
        assert m2["samples"] == 12
    state_one, state_two = _load(runs[1] / "a.pt"), _load(runs[2] / "a.pt")
    from safetensors.torch import load_file

    initial = load_file(tiny_model_dir / "model.safetensors")
    moved = max(float((state_two[k] - v).abs().max()) for k, v in initial.items() if k in state_two)
    assert moved > 1e-3
    # Weights agree to 0.1% (in norm) of how far training moved them. Element-wise equality is not the
    # test: Adam divides by each gradient's own size, so an element whose gradient is rounding noise
    # (which differs with the reduction order of two ranks) takes a full-size step either way.
    assert state_one.keys() == state_two.keys()
    for name, tensor in state_one.items():
        if name not in initial or name.endswith("k_proj.bias"):
            continue  # k_proj.bias: softmax ignores a shift shared by every key, its gradient is ~0
        step = float((tensor - initial[name]).norm())
        assert float((state_two[name] - tensor).norm()) <= 1e-3 * step + 1e-7, name


@pytest.mark.parametrize("nproc", [1, 2])
def test_checkpoint_round_trip_resumes_exactly(runs: dict[int, Path], nproc: int) -> None:
    report = json.loads((runs[nproc] / "metrics.json").read_text())
    assert report["extra"] == {"applied": "0-0,0-1"}
    for ma, mb in zip(report["a"][2:], report["b"], strict=True):
        assert mb == pytest.approx(ma, abs=1e-6)
    _assert_same(_load(runs[nproc] / "a.pt"), _load(runs[nproc] / "b.pt"), atol=1e-6)


@pytest.fixture(scope="module")
def ppo_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker's output folder for PPO with a critic (gae) over 2 ranks."""
    out = tmp_path_factory.mktemp("fsdp-ppo") / "world2"
    proc = start_worker(2, tiny_model_dir, out, advantage="gae")
    try:
        wait_worker(proc, out, time.monotonic() + TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out


def test_ppo_checkpoint_round_trip_carries_the_critic(ppo_run: Path) -> None:
    report = json.loads((ppo_run / "metrics.json").read_text())
    assert report["world_size"] == 2
    for ma, mb in zip(report["a"][2:], report["b"], strict=True):
        assert mb == pytest.approx(ma, abs=1e-6)
        assert ma["critic_grad_norm"] > 0
    _assert_same(_load(ppo_run / "a.pt"), _load(ppo_run / "b.pt"), atol=1e-6)
    _assert_same(_load(ppo_run / "critic_a.pt"), _load(ppo_run / "critic_b.pt"), atol=1e-6)


def test_lora_adapters_shard_train_alike_and_resume(lora_runs: dict[int, Path], tiny_model_dir: Path) -> None:
    """LoRA under FSDP2: the published (merged) weights of 2 ranks match 1 rank's, the frozen base weights
    outside the adapted layers never move, and a checkpoint round trip resumes exactly."""
    one, two = (json.loads((lora_runs[n] / "metrics.json").read_text()) for n in (1, 2))
    for m1, m2 in zip(one["a"], two["a"], strict=True):
        assert m2 == pytest.approx(m1, abs=1e-5)
        assert m2["grad_norm"] > 0
    assert all(m["kl"] > 0 for m in two["a"][1:])  # the policy leaves its reference (the adapters off)
    from safetensors.torch import load_file

    initial = load_file(tiny_model_dir / "model.safetensors")
    merged_one, merged_two = _load(lora_runs[1] / "a.pt"), _load(lora_runs[2] / "a.pt")
    assert merged_two.keys() == merged_one.keys() and set(initial) <= set(merged_two)
    adapted = [k for k in initial if any(f"{m}.weight" in k for m in ("q_proj", "down_proj"))]
    assert adapted and all(float((merged_two[k] - initial[k]).abs().max()) > 1e-6 for k in adapted)
    for name in initial:
        if "norm" in name or "embed" in name or name.endswith(".bias"):
            torch.testing.assert_close(merged_two[name], initial[name], atol=0, rtol=0, msg=name)
        step = float((merged_one[name] - initial[name]).norm())
        assert float((merged_two[name] - merged_one[name]).norm()) <= 1e-3 * step + 1e-6, name
    for nproc in (1, 2):
        report = json.loads((lora_runs[nproc] / "metrics.json").read_text())
        for ma, mb in zip(report["a"][2:], report["b"], strict=True):
            assert mb == pytest.approx(ma, abs=1e-6)
        _assert_same(_load(lora_runs[nproc] / "a.pt"), _load(lora_runs[nproc] / "b.pt"), atol=1e-6)
