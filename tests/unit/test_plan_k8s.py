"""`rlfabric plan --k8s`: a strategic-merge patch whose objects are the workloads of deploy/k8s/base (and
the rollout autoscaler of components/keda or components/hpa) by kind and name, with GPU counts, learner
nodes and memory from the plan; the gpu overlay renders with it (`kubectl kustomize`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfabric.cli import main

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
RUN_FILE = "examples/plan/qwen7b-grpo.toml"
DEVICES = "learner=16xcuda:80GiB,rollout=6xcuda:80GiB"


def objects(folder: Path) -> set[tuple[str, str]]:
    """(kind, name) of every object in the folder's YAML files."""
    found = set()
    for file in folder.glob("*.yaml"):
        for doc in yaml.safe_load_all(file.read_text()):
            if isinstance(doc, dict) and "kind" in doc and "metadata" in doc:
                found.add((doc["kind"], doc["metadata"]["name"]))
    return found


def patch(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, list[dict[str, Any]]]:
    assert main(["plan", RUN_FILE, "--k8s", *args]) in (0, 1)
    text = capsys.readouterr().out
    return text, list(yaml.safe_load_all(text))


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("autoscaler", ["keda", "hpa"])
def test_the_patch_names_objects_of_the_base_and_the_autoscaler_component(
    capsys: pytest.CaptureFixture[str], autoscaler: str
) -> None:
    _, docs = patch(capsys, "--devices", DEVICES, "--autoscaler", autoscaler)
    known = objects(K8S / "base") | objects(K8S / "components" / autoscaler)
    named = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert named <= known, named - known
    assert {("Job", "rlfabric-learner"), ("Deployment", "rlfabric-rollout")} <= named


def test_the_patch_carries_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    _, docs = patch(capsys, "--devices", DEVICES)
    by_kind = {d["kind"]: d for d in docs}
    job = by_kind["Job"]["spec"]
    assert job["completions"] == job["parallelism"] == 2  # 16 GPUs, 8 per node
    learner = job["template"]["spec"]["containers"][0]
    assert learner["name"] == "learner"
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {e["name"]: e["value"] for e in learner["env"]} == {
        "LEARNER_NODES": "2",
        "LEARNER_PROCS_PER_NODE": "8",
    }
    assert by_kind["PodDisruptionBudget"]["spec"]["minAvailable"] == 2
    scaled = by_kind["ScaledObject"]["spec"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (6, 12)
    affinity = by_kind["Deployment"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    term = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["key"] == "nvidia.com/gpu.memory"
    assert int(term["matchExpressions"][0]["values"][0]) > 0


def test_cpu_roles_get_memory_requests_and_limits_with_the_margin(capsys: pytest.CaptureFixture[str]) -> None:
    _, docs = patch(capsys, "--devices", "learner=2xcpu:256GiB,rollout=2xcpu:64GiB", "--autoscaler", "none")
    rollout = next(d for d in docs if d["kind"] == "Deployment")
    resources = rollout["spec"]["template"]["spec"]["containers"][0]["resources"]
    request, limit = (int(resources[k]["memory"].removesuffix("Mi")) for k in ("requests", "limits"))
    assert request > 0 and limit == pytest.approx(request * 1.2, abs=1)
    assert not any(d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler") for d in docs)


def test_a_colocated_plan_has_no_k8s_patch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", RUN_FILE, "--k8s", "--devices", "8xcuda:80GiB"]) == 2
    assert "disaggregated" in capsys.readouterr().err


def test_the_gpu_overlay_renders_with_the_patch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not on PATH: the deployment tests render the overlays with `kubectl kustomize`"
        )
    text, _ = patch(capsys, "--devices", "learner=24xcuda:80GiB,rollout=5xcuda:80GiB")  # not the overlay's
    copy = shutil.copytree(K8S, tmp_path / "k8s")
    overlay = copy / "overlays" / "gpu"
    (overlay / "patches" / "plan.yaml").write_text(text)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    kustomization["patches"].append({"path": "patches/plan.yaml"})
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(done.stdout) if d}
    job = rendered[("Job", "rlfabric-learner")]
    assert job["spec"]["completions"] == 3
    assert rendered[("PodDisruptionBudget", "rlfabric-learner")]["spec"]["minAvailable"] == 3
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LEARNER_PROCS_PER_NODE"] == "8" and "JOB_COMPLETION_INDEX" in env  # merged, not replaced
    assert rendered[("ScaledObject", "rlfabric-rollout")]["spec"]["minReplicaCount"] == 5
