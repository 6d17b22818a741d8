"""The Kubernetes manifests: every overlay renders, every object validates against the Kubernetes schemas
(KEDA's ScaledObject, a CRD, structurally), and every rlfabric container's command line and environment
load through the real CLI and config loader, with the values the rest of the manifests rely on."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_manifests import (
    K8S,
    OVERLAYS,
    POD_IP,
    SECRET_TEMPLATES,
    Container,
    check_command,
    find,
    localize,
    pod_template,
    render,
    render_path,
    rlfabric_argv,
    rlfabric_containers,
)

KUBERNETES_VERSION = "1.30.0"
"""Oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27; PDB policy/v1)."""
AUTOSCALED_METRIC = "rlfabric_coordinator_desired_replicas"


@functools.cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(overlay)


def run_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The run file the overlay submits (ConfigMap rlfabric-run, key run.yaml)."""
    return dict(yaml.safe_load(find(objects, "ConfigMap", "rlfabric-run")["data"]["run.yaml"]))


def container(objects: list[dict[str, Any]], kind: str, name: str, container_name: str) -> Container:
    for c in rlfabric_containers(objects):
        meta = c.workload["metadata"]["name"]
        if c.workload["kind"] == kind and meta == name and c.spec["name"] == container_name:
            return c
    raise AssertionError(f"no rlfabric container {container_name} in {kind} {name}")


def served_config(c: Container, tmp_path: Path) -> dict[str, Any]:
    """The effective configuration of a `serve` container, loaded by the real CLI."""
    _, argv = rlfabric_argv(c)
    config = check_command(localize(argv, c.files, tmp_path), c.env, c.name)
    assert config is not None, f"{c.name} does not run `rlfabric serve`"
    return config


def test_there_are_overlays() -> None:
    assert {"cpu-dev", "gpu"} <= set(OVERLAYS)


# --- rendering and schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    import kubernetes_validate

    objects = rendered(overlay)
    assert objects, f"{overlay} renders nothing"
    for obj in objects:
        if obj["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            continue  # a CRD: checked structurally (below; test_monitoring.py)
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "rlfabric", f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("path", SECRET_TEMPLATES, ids=lambda p: p.name)
def test_secret_templates_validate_and_hold_no_secret(path: Path) -> None:
    import kubernetes_validate

    secret = yaml.safe_load(path.read_text())
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    for key, value in secret["stringData"].items():
        assert "REPLACE" in value, f"{path.name}: {key} looks like a real value"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_selects_pods_and_names_real_ports(overlay: str) -> None:
    objects = rendered(overlay)
    pods = [pod_template(o) for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert chosen, f"Service {service['metadata']['name']} selects no pod"
        names = {
            port.get("name") for p in chosen for c in p["spec"]["containers"] for port in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert isinstance(target, int) or target in names, f"{service['metadata']['name']}: {target}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_sized_and_unprivileged(overlay: str) -> None:
    for workload in (o for o in rendered(overlay) if o["kind"] in ("Deployment", "StatefulSet", "Job")):
        spec = pod_template(workload)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, workload["metadata"]["name"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"{workload['metadata']['name']}:{c['name']}"
            assert c["resources"]["requests"] and c["resources"]["limits"].get("memory"), where
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where


# --- the real CLI and config loader ---------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rlfabric_command_loads_through_the_cli(overlay: str, tmp_path: Path) -> None:
    containers = list(rlfabric_containers(rendered(overlay)))
    assert len(containers) >= 5
    for c in containers:
        _, argv = rlfabric_argv(c)
        check_command(localize(argv, c.files, tmp_path), c.env, c.name)


def grpc_probes(c: Container) -> list[dict[str, Any]]:
    probes = [c.spec.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
    return [p["grpc"] for p in probes if p and "grpc" in p]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_binds_its_pod_ip_and_follows_the_run(overlay: str, tmp_path: Path) -> None:
    objects = rendered(overlay)
    c = container(objects, "Deployment", "rlfabric-rollout", "rollout")
    config, spec = served_config(c, tmp_path), run_spec(objects)
    # The registry entry is server.host:port; it must be an address the coordinator can dial.
    assert config["server"]["host"] == POD_IP
    assert config["server"]["port"] == c.port("grpc")
    assert config["server"]["metrics_port"] == int(c.pod["metadata"]["annotations"]["prometheus.io/port"])
    assert config["run_id"] == spec["name"]
    assert config["weights_root"] == spec["weights"]["url"]
    assert config["engine"]["model"] == spec["model"]["path"]
    assert config["redis"]["url"].startswith("redis://rlfabric-redis:")
    assert config["learner_token"], "UpdateWeights must require the learner token"
    assert config["client_token"], "Generate must require the clients' token"
    assert config["client_token"] != config["learner_token"]
    assert config["server"]["grace_period_s"] < c.pod["spec"]["terminationGracePeriodSeconds"]
    # Ready only when serving a published version: the per-service health status, on the gRPC port.
    probes = grpc_probes(c)
    assert {p["port"] for p in probes} == {c.port("grpc")}
    assert c.spec["readinessProbe"]["grpc"]["service"] == "rlfabric.v1.RolloutService"
    assert c.spec["startupProbe"]["grpc"]["service"] == "rlfabric.v1.RolloutService"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_reward_serves_where_probes_and_the_coordinator_look(overlay: str, tmp_path: Path) -> None:
    objects = rendered(overlay)
    reward = container(objects, "Deployment", "rlfabric-reward", "reward")
    config = served_config(reward, tmp_path)
    assert config["server"]["host"] == "0.0.0.0"
    assert {p["port"] for p in grpc_probes(reward)} == {config["server"]["port"]}
    assert config["server"]["metrics_port"] == int(
        reward.pod["metadata"]["annotations"]["prometheus.io/port"]
    )
    coordinator = served_config(
        container(objects, "Deployment", "rlfabric-coordinator", "coordinator"), tmp_path
    )
    service = find(objects, "Service", "rlfabric-reward")
    assert coordinator["reward_address"] == f"rlfabric-reward:{service['spec']['ports'][0]['port']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_serves_its_api_and_metrics_on_one_port(overlay: str, tmp_path: Path) -> None:
    c = container(rendered(overlay), "Deployment", "rlfabric-coordinator", "coordinator")
    config = served_config(c, tmp_path)
    assert config["api"]["host"] == "0.0.0.0"
    assert config["api"]["port"] == c.port("http")
    assert c.pod["metadata"]["annotations"]["prometheus.io/port"] == str(c.port("http"))
    assert config["api"]["token"], "the API must require a token"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_learner_trains_the_submitted_run_on_a_consistent_world(overlay: str, tmp_path: Path) -> None:
    from rlfabric.runspec import RunSpec

    objects = rendered(overlay)
    c = container(objects, "Job", "rlfabric-learner", "learner")
    torchrun, _ = rlfabric_argv(c)
    config = served_config(c, tmp_path)
    spec = RunSpec.model_validate(run_spec(objects))
    assert RunSpec.model_validate(config["run"]) == spec
    assert config["run_id"] == spec.name and config["consumer_name"]
    assert config["redis"]["url"].startswith("redis://rlfabric-redis:")
    # One torchrun per pod of the Indexed Job; rank 0 on pod 0, reached through the headless Service.
    job = c.workload["spec"]
    nodes = int(torchrun.nnodes)
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == nodes
    assert torchrun.node_rank == 0  # JOB_COMPLETION_INDEX of pod 0
    pod = c.pod["spec"]
    assert torchrun.master_addr == f"{c.workload['metadata']['name']}-0.{pod['subdomain']}"
    headless = find(objects, "Service", pod["subdomain"])["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert torchrun.master_port in [p["port"] for p in headless["ports"]]
    assert find(objects, "PodDisruptionBudget", "rlfabric-learner")["spec"]["minAvailable"] == nodes
    # Checkpoints go to a volume; several nodes need a shared one.
    mounts = {m["mountPath"]: m["name"] for m in c.spec["volumeMounts"]}
    assert any(spec.output_dir.startswith(path) for path in mounts), "output_dir is on no volume"
    if nodes > 1:
        assert (
            "ReadWriteMany" in find(objects, "PersistentVolumeClaim", "rlfabric-runs")["spec"]["accessModes"]
        )


# (workload kind, name, container, config key, Secret key): every credential issue 17 agreed, from the Secret.
CREDENTIALS = [
    ("Deployment", "rlfabric-reward", "reward", "token", "reward-token"),
    ("Deployment", "rlfabric-coordinator", "coordinator", "api.token", "api-token"),
    ("Deployment", "rlfabric-coordinator", "coordinator", "reward_token", "reward-token"),
    ("Deployment", "rlfabric-coordinator", "coordinator", "learner_token", "learner-status-token"),
    ("Deployment", "rlfabric-coordinator", "coordinator", "rollout_token", "rollout-token"),
    ("Deployment", "rlfabric-rollout", "rollout", "learner_token", "learner-token"),
    ("Deployment", "rlfabric-rollout", "rollout", "client_token", "rollout-token"),
    ("Job", "rlfabric-learner", "learner", "publish_token", "learner-token"),
    ("Job", "rlfabric-learner", "learner", "token", "learner-status-token"),
]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_holds_its_credentials_from_the_secret(overlay: str, tmp_path: Path) -> None:
    """Each token comes from the rlfabric-tokens Secret through `valueFrom.secretKeyRef` (never a literal
    in a manifest), lands on the config key the service checks, and no service runs `--insecure`: both
    ends of each credential read the same Secret key, so they agree."""
    objects = rendered(overlay)
    for kind, name, container_name, key, secret_key in CREDENTIALS:
        c = container(objects, kind, name, container_name)
        config = served_config(c, tmp_path)
        for part in key.split("."):
            config = config[part]
        variable = f"RLFABRIC_{container_name.upper()}__{key.upper().replace('.', '__')}"
        [var] = [v for v in c.spec["env"] if v["name"] == variable]
        ref = var["valueFrom"]["secretKeyRef"]
        assert re.fullmatch(r"rlfabric-tokens(-[a-z0-9]+)?", ref["name"]), ref  # kustomize adds a hash
        assert ref["key"] == secret_key, variable
        assert config and config == c.env[variable], f"{c.name}: {key} is not set from {variable}"
        assert not served_config(c, tmp_path)["insecure"], f"{c.name} serves without credentials"
        assert "--insecure" not in c.argv()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinator_can_read_the_dataset_of_the_run(overlay: str, tmp_path: Path) -> None:
    from rlfabric.runspec import RunSpec
    from rlfabric.runtime.paths import Roots, violations

    objects = rendered(overlay)
    c = container(objects, "Deployment", "rlfabric-coordinator", "coordinator")
    dataset = run_spec(objects)["dataset"]["path"]
    assert any(dataset.startswith(m["mountPath"] + "/") for m in c.spec["volumeMounts"]), dataset
    config = served_config(c, tmp_path)
    roots = Roots.of(config["data_roots"], config["model_roots"])
    assert violations(RunSpec.model_validate(run_spec(objects)), roots) == []  # it accepts the run's paths


def test_cpu_dev_prompts_are_the_demo_prompts(tmp_path: Path) -> None:
    from rlfabric.coordinator.demo import write_dataset

    write_dataset(tmp_path / "demo.jsonl")
    shipped = K8S / "overlays" / "cpu-dev" / "demo-prompts.jsonl"
    assert shipped.read_text() == (tmp_path / "demo.jsonl").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_resources_only_where_asked(overlay: str) -> None:
    objects = rendered(overlay)
    for kind, name in (("Deployment", "rlfabric-rollout"), ("Job", "rlfabric-learner")):
        limits = pod_template(find(objects, kind, name))["spec"]["containers"][0]["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (overlay == "gpu"), f"{overlay}: {name}"


# --- stateful services, policies --------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_is_durable_and_never_evicts(overlay: str) -> None:
    objects = rendered(overlay)
    conf = find(objects, "ConfigMap", "rlfabric-redis")["data"]["redis.conf"].splitlines()
    assert "appendonly yes" in conf and "maxmemory-policy noeviction" in conf
    redis = find(objects, "StatefulSet", "rlfabric-redis")["spec"]
    assert redis["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert redis["template"]["spec"]["containers"][0]["args"] == ["/etc/redis/redis.conf"]


def policy(objects: list[dict[str, Any]], app: str) -> dict[str, Any]:
    return dict(find(objects, "NetworkPolicy", app)["spec"])


def sources(rule: dict[str, Any]) -> set[str]:
    return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for peer in rule.get("from", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay: str) -> None:
    objects = rendered(overlay)
    default = policy(objects, "rlfabric-default-deny-ingress")
    assert default["podSelector"] == {} and default["policyTypes"] == ["Ingress"] and "ingress" not in default
    reward = policy(objects, "rlfabric-reward")
    assert "Egress" in reward["policyTypes"] and reward["egress"] == []
    rollout = policy(objects, "rlfabric-rollout")
    grpc_rules = [r for r in rollout["ingress"] if {"port": 50051} in r["ports"]]
    assert len(grpc_rules) == 1
    assert sources(grpc_rules[0]) == {"rlfabric-coordinator", "rlfabric-learner"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_service_is_headless(overlay: str) -> None:
    service = find(rendered(overlay), "Service", "rlfabric-rollout")["spec"]
    assert service["clusterIP"] == "None"
    assert "publishNotReadyAddresses" not in service  # only replicas serving current weights resolve


# --- autoscaling ------------------------------------------------------------------------------------------


def autoscalers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_exactly_one_autoscaler_targets_the_rollout_deployment(overlay: str) -> None:
    objects = rendered(overlay)
    (scaler,) = autoscalers(objects)
    target = scaler["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] == "rlfabric-rollout"
    assert "replicas" not in find(objects, "Deployment", "rlfabric-rollout")["spec"], "the autoscaler owns it"


def check_scaled_object(obj: dict[str, Any], run_id: str) -> None:
    """KEDA's ScaledObject (keda.sh/v1alpha1) is a CRD the schemas do not cover: its fields, by hand."""
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    spec = obj["spec"]
    known = {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"}
    known |= {"advanced", "triggers", "idleReplicaCount", "fallback", "initialCooldownPeriod"}
    assert set(spec) <= known, set(spec) - known
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["pollingInterval"] > 0 and spec["cooldownPeriod"] >= 0
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
    meta = trigger["metadata"]
    assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata values are strings"
    assert float(meta["threshold"]) > 0 and meta["serverAddress"].startswith("http")
    assert re.search(rf'{AUTOSCALED_METRIC}\{{run_id="{re.escape(run_id)}"\}}', meta["query"]), meta["query"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert set(behavior) <= {"scaleUp", "scaleDown"}


def check_hpa(obj: dict[str, Any], run_id: str) -> None:
    spec = obj["spec"]
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    (metric,) = spec["metrics"]
    external = metric["external"]
    assert external["metric"]["name"] == AUTOSCALED_METRIC
    assert external["metric"]["selector"]["matchLabels"] == {"run_id": run_id}
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_follows_the_coordinators_gauge_for_this_run(overlay: str) -> None:
    objects = rendered(overlay)
    run_id = run_spec(objects)["name"]
    for scaler in autoscalers(objects):
        (check_scaled_object if scaler["kind"] == "ScaledObject" else check_hpa)(scaler, run_id)


def test_both_autoscaling_components_render_with_the_same_bounds(tmp_path: Path) -> None:
    """Each overlay uses one component; this builds the other one too, on the base, and checks it."""
    import kubernetes_validate

    for component in ("keda", "hpa"):
        (tmp_path / component).mkdir()
        (tmp_path / component / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [os.path.relpath(K8S / "base", tmp_path / component)],
                    "components": [os.path.relpath(K8S / "components" / component, tmp_path / component)],
                    "configMapGenerator": [{"name": "rlfabric-run", "literals": ["run.yaml=name: demo"]}],
                }
            )
        )
    keda = render_path(tmp_path / "keda")
    hpa = render_path(tmp_path / "hpa")
    (scaled,) = autoscalers(keda)
    (plain,) = autoscalers(hpa)
    check_scaled_object(scaled, "demo")
    check_hpa(plain, "demo")
    kubernetes_validate.validate(plain, KUBERNETES_VERSION, strict=True)
    assert scaled["spec"]["minReplicaCount"] == plain["spec"]["minReplicas"]
    assert scaled["spec"]["maxReplicaCount"] == plain["spec"]["maxReplicas"]
    keda_behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert keda_behavior == plain["spec"]["behavior"]


def test_prometheus_adapter_rule_serves_the_gauge() -> None:
    values = yaml.safe_load((K8S / "components" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["external"]
    assert AUTOSCALED_METRIC in rule["seriesQuery"] and rule["name"]["as"] == AUTOSCALED_METRIC
    assert "by (run_id)" in rule["metricsQuery"]
