"""The benchmarks' --quick mode, as CI runs it: every code path of `bench/reward_service.py` (two real
reward services, in-process scoring, the raw asyncio stub) on tiny sizes, checked through its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_reward_service_bench_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reward_service.py"), "--quick", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "reward_service.json").read_text())
    assert (tmp_path / "reward_service.md").read_text().startswith("## reward_service")

    assert result["quick"] is True and result["batch_size"] == 64
    math_verify, exact_match = result["math_verify"], result["exact_match"]
    assert math_verify["in_process"]["items_per_s"]["median"] > 0
    assert set(math_verify["service"]) == {"workers=1", "workers=2"}
    for entry in math_verify["service"].values():
        assert entry["items_per_s"]["median"] > 0
        assert entry["ratio_per_core"] > 0
        assert entry["latency_ms"]["p99"] >= entry["latency_ms"]["p50"] > 0
        assert set(entry["statuses"]) == {"ok"}
    assert exact_match["in_process"]["items_per_s"]["median"] > 0
    assert exact_match["service"]
    for entry in exact_match["service"].values():
        assert entry["items_per_s"]["median"] > 0
        assert entry["vs_in_process"] > 0
        assert entry["calls"] > 0
    assert exact_match["best_service_items_per_s"] > 0
    assert isinstance(exact_match["goal_met"], bool)


def run_quick(script: str, tmp_path: Path, timeout: int) -> dict:
    """Runs `bench/<script>.py --quick` into `tmp_path`; returns its JSON after checking the markdown."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{script}.py"), "--quick", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / f"{script}.md").read_text().startswith(f"## {script}")
    return json.loads((tmp_path / f"{script}.json").read_text())


@pytest.mark.vllm
def test_rollout_service_bench_quick(tmp_path: Path) -> None:
    result = run_quick("rollout_service", tmp_path, timeout=600)
    assert result["quick"] is True
    throughput = result["result"]["throughput"]
    for side in ("service", "in_process", "hf_in_process"):
        assert throughput[side]["tokens_per_s"]["median"] > 0
        assert all(t > 0 for t in throughput[side]["tokens"])
    assert throughput["ratio"] > 0 and throughput["vllm_vs_hf"] > 0
    (updates,) = result["result"]["weight_updates"]
    assert updates["preset"] == "tiny" and updates["bytes"] > 0
    assert set(updates["paths"]) == {"object_store", "broadcast"}
    for phases in updates["paths"].values():
        assert phases["total_s"]["median"] >= phases["update_rpc_s"]["median"] > 0


def test_sft_step_bench_quick(tmp_path: Path) -> None:
    """Three steps of the agentic demonstrations on each side: packed and padded train alike."""
    result = run_quick("sft_step", tmp_path, timeout=300)
    r = result["result"]
    assert result["quick"] is True and r["load"] == "tools" and r["examples_per_step"] == 16
    assert all(len(losses) == 3 for losses in r["losses"].values())
    assert r["max_loss_difference"] < 1e-4
    assert r["losses"]["packed"][-1] < r["losses"]["packed"][0]  # it trains
    assert all(s["median"] > 0 for s in r["tokens_per_s"].values()) and r["packing_ratio"] > 0


def test_learner_step_bench_quick(tmp_path: Path) -> None:
    result = run_quick("learner_step", tmp_path, timeout=300)
    assert result["quick"] is True and result["result"]["load"]["preset"] == "tiny"
    tokens_per_s = result["result"]["tokens_per_s"]
    assert set(tokens_per_s) == {"learner", "learner_padded", "plain"}
    assert all(side["median"] > 0 for side in tokens_per_s.values())
    assert result["result"]["ratio"] > 0 and result["result"]["packing_ratio"] > 0
    assert isinstance(result["goal_met"], bool)


def test_rollout_busy_bench_quick(tmp_path: Path) -> None:
    result = run_quick("rollout_busy", tmp_path, timeout=600)
    assert result["quick"] is True and result["engine"] == "transformers"
    assert set(result["busy_fraction"]) == {"async (max_staleness 1)", "sync (max_staleness 0)"}
    for runs in result["runs"].values():
        (run,) = runs
        assert 0 < run["busy_fraction"] <= 1
        assert run["steps"] == 2 and run["dropped_stale"] == 0
    assert isinstance(result["goal_met"], bool)


def test_rollout_scaling_bench_quick(tmp_path: Path) -> None:
    """Three transformers-engine replicas: 1 vs 2 replicas, then the cost cells on one of them."""
    result = run_quick("rollout_scaling", tmp_path, timeout=300)
    assert result["quick"] is True and result["engine"] == "transformers" and result["goal"] is None
    plan, load = result["plan"], result["plan"]["load"]
    scaling = result["result"]["replicas"]
    assert set(scaling["configs"]) == {"1 replica", "2 replicas"}
    for config in scaling["configs"].values():
        assert config["tokens_per_s"]["median"] > 0 and config["samples_per_s"]["median"] > 0
        (run,) = config["runs"]
        assert set(run["groups_per_replica"]) == set(config["replicas"])
        assert all(groups > 0 for groups in run["groups_per_replica"].values())
        assert sum(run["groups_per_replica"].values()) == run["groups"] == load["prompts"]
        assert run["samples"] == load["prompts"] * load["n"]
        assert 0 < run["tokens"] <= run["samples"] * load["max_tokens"]
    assert scaling["ratio_tokens_per_s"] > 0 and scaling["ratio_samples_per_s"] > 0
    cells = result["result"]["cost"]["cells"]
    by_length = {(length, load["n"]) for length in plan["lengths"]}
    by_n = {(load["max_tokens"], n) for n in plan["group_sizes"]}
    assert {(c["max_tokens"], c["n"]) for c in cells} == by_length | by_n
    assert [c["base"] for c in cells].count(True) == 1
    for c in cells:
        assert c["tokens_per_s"]["median"] > 0 and c["seconds_per_group"]["median"] > 0
        assert 0 < c["mean_completion"]["median"] <= c["max_tokens"]
        assert c["tokens_per_s_vs_base"]["median"] > 0


def test_e2e_trl_bench_quick(tmp_path: Path) -> None:
    """rlfabric up and TRL's GRPOTrainer on the same tiny task. TRL comes with the `bench` extra, which
    CI installs (scripts/bootstrap.sh): a missing TRL fails here rather than skipping."""
    result = run_quick("e2e_trl", tmp_path, timeout=900)
    assert result["quick"] is True and result["preset"] == "tiny"
    task = result["task"]
    for system in ("rlfabric", "trl"):
        (run,) = result["runs"][system]
        assert len(run["steps"]) == task["steps"] == 2
        assert run["samples_trained"] == task["steps"] * task["group_size"] * task["prompts_per_step"]
        assert run["samples_per_s"] > 0 and 0 <= run["reward_final"] <= 1
        assert run["reward_final_se"] >= 0  # NaN fails: every step reported its reward spread
        assert run["cores_used_steady"] >= 0  # sampled once a second: a short step may fall between
    assert set(result["runs"]["trl"][0]["split"]) == {"generate_s", "prepare_s", "train_s"}
    assert {"train_s", "publish_s", "replica_busy_fraction"} <= set(result["runs"]["rlfabric"][0]["split"])
    assert result["comparison"]["throughput_ratio"] > 0 and isinstance(result["comparison"]["goal_met"], bool)
    assert task["learner_compile"] is True  # the bench's default: the learner ran with train.compile
    assert task["dtype"] == "float32"  # --dtype auto, which the suite pins to float32 (RLFABRIC_AUTO_DTYPE)
    # start-up: every process `up` launched reported its ready time; the default is a cold compile cache
    ready = result["runs"]["rlfabric"][0]["ready_s"]
    assert {"redis", "reward", "rollout-0", "learner", "coordinator"} <= set(ready)
    assert all(seconds >= 0 for seconds in ready.values()) and result["compile_cache"] == "cold"


@pytest.mark.vllm
def test_rollout_memory_bench_quick(tmp_path: Path) -> None:
    """A real replica process loads each published version (the bench asserts it served it) and every
    process of its tree is sampled: the front end, vLLM's engine core and its worker."""
    result = run_quick("rollout_memory", tmp_path, timeout=600)
    assert result["quick"] is True and result["versions"] == 6
    assert [s["version"] for s in result["samples"]] == [0, 2, 4, 6]
    processes = result["summary"]["processes"]
    assert {"front end", "VLLM::EngineCore", "VLLM::Worker", "tree"} <= set(processes)
    tree = processes["tree"]["pss"]
    assert tree["end_mib"] > processes["VLLM::Worker"]["pss"]["end_mib"] > 0
    assert isinstance(result["goal_met"], bool)
    assert (tmp_path / "rollout_memory.png").stat().st_size > 0
