"""Helpers of the deployment tests: render the kustomize overlays, find the rlfabric containers in them,
resolve their environment the way the kubelet does, and run their command lines through the real CLI.

A container's configuration is checked by what it would really do: its environment is built from
`env` and `envFrom` (ConfigMaps and Secrets from the rendered objects, or the Secret templates in
deploy/k8s/secrets/ for Secrets an operator creates), `$(VAR)` references are expanded, files named on
the command line are taken from the ConfigMaps or bind mounts that provide them, and then
`rlfabric.cli.main([... "--print-config"])` loads the configuration exactly as `rlfabric serve` would.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SECRET_TEMPLATES = sorted((K8S / "secrets").glob("*.template.yaml"))
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")
RLFABRIC_IMAGES = ("rlfabric", "ghcr.io/rlfabric/rlfabric")
POD_IP = "10.1.2.3"
"""What the downward API's status.podIP stands for in these tests."""


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize` renders for deploy/k8s/overlays/OVERLAY (fails without kubectl)."""
    return render_path(K8S / "overlays" / overlay)


def render_path(path: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize PATH` renders."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not on PATH: the deployment tests render the kustomize overlays with "
            "`kubectl kustomize` (kubectl >= 1.27, built-in kustomize v5). Install kubectl to run them."
        )
    done = subprocess.run(
        [kubectl, "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def secret_templates() -> list[dict[str, Any]]:
    """The Secret templates an operator fills in and applies before an overlay that does not generate them."""
    return [yaml.safe_load(path.read_text()) for path in SECRET_TEMPLATES]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The rendered object of `kind` named `name` (generated names carry a hash suffix: a prefix match)."""
    matches = [o for o in objects if o["kind"] == kind and _named(o, name)]
    assert matches, f"no {kind} {name} rendered"
    return matches[0]


def _named(obj: dict[str, Any], name: str) -> bool:
    actual = obj["metadata"]["name"]
    return bool(actual == name or re.fullmatch(re.escape(name) + r"-[a-z0-9]{10}", actual))


def is_rlfabric_image(image: str) -> bool:
    return image.rsplit(":", 1)[0] in RLFABRIC_IMAGES


# --- containers and their environment ---------------------------------------------------------------


@dataclass
class Container:
    """One rlfabric container of a rendered workload, with what the kubelet would give it."""

    workload: dict[str, Any]
    spec: dict[str, Any]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    """Files mounted from ConfigMaps: absolute path in the container -> content."""

    @property
    def name(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}:{self.spec['name']}"

    @property
    def pod(self) -> dict[str, Any]:
        return pod_template(self.workload)

    def argv(self) -> list[str]:
        """command + args with $(VAR) expanded; the image's entry point is `rlfabric`."""
        words = [*(self.spec.get("command") or ["rlfabric"]), *(self.spec.get("args") or [])]
        return [expand(word, self.env) for word in words]

    def port(self, name: str) -> int:
        ports = {p.get("name"): p["containerPort"] for p in self.spec.get("ports", [])}
        assert name in ports, f"{self.name} declares no port named {name!r}"
        return int(ports[name])


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"])


def rlfabric_containers(objects: list[dict[str, Any]]) -> Iterator[Container]:
    """Every container (init containers too) running the rlfabric image in the rendered workloads."""
    for workload in objects:
        if workload["kind"] not in WORKLOADS:
            continue
        pod = pod_template(workload)
        for spec in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
            if is_rlfabric_image(spec["image"]):
                env = resolve_env(spec, pod, objects)
                yield Container(workload, spec, env, mounted_files(spec, pod, objects))


def secret_data(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    """A Secret's decoded data, from the render or else from the templates in deploy/k8s/secrets/."""
    for source in (objects, secret_templates()):
        for obj in source:
            if obj["kind"] == "Secret" and _named(obj, name):
                data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
                return {**data, **(obj.get("stringData") or {})}
    raise AssertionError(f"Secret {name} is neither rendered nor templated in deploy/k8s/secrets/")


def configmap_data(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    return dict(find(objects, "ConfigMap", name).get("data") or {})


def field_value(path: str, pod: dict[str, Any]) -> str:
    """What the downward API would put in an env var for `fieldRef.fieldPath`."""
    known = {
        "status.podIP": POD_IP,
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
        "metadata.name": "pod-0",
        "metadata.namespace": "rlfabric",
        "spec.nodeName": "node-0",
    }
    assert path in known, f"fieldRef {path!r} is not one the tests know how to stand in for"
    return known[path]


def resolve_env(spec: dict[str, Any], pod: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment: envFrom first, then env in order (later entries may use $(EARLIER))."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmap_data(objects, source["configMapRef"]["name"]))
        else:
            env.update(secret_data(objects, source["secretRef"]["name"]))
    for var in spec.get("env", []):
        env[var["name"]] = env_value(var, pod, objects, env)
    return env


def env_value(
    var: dict[str, Any], pod: dict[str, Any], objects: list[dict[str, Any]], env: dict[str, str]
) -> str:
    if "value" in var:
        return expand(str(var["value"]), env)
    source = var["valueFrom"]
    if "fieldRef" in source:
        return field_value(source["fieldRef"]["fieldPath"], pod)
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        data = configmap_data(objects, ref["name"])
    else:
        ref = source["secretKeyRef"]
        data = secret_data(objects, ref["name"])
    assert ref["key"] in data, f"env {var['name']}: key {ref['key']!r} not in {ref['name']}"
    return data[ref["key"]]


def expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values ($$ escapes; unknown names stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: _expand_one(m, env), word)


def _expand_one(match: re.Match[str], env: dict[str, str]) -> str:
    if match.group(0) == "$$":
        return "$"
    return env.get(match.group(1), match.group(0))


def mounted_files(spec: dict[str, Any], pod: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """Files the container sees from ConfigMap volumes: mount path / key -> content."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    files = {}
    for mount in spec.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            for key, content in configmap_data(objects, volume["configMap"]["name"]).items():
                files[f"{mount['mountPath'].rstrip('/')}/{key}"] = content
    return files


# --- the real CLI --------------------------------------------------------------------------------------


def localize(argv: list[str], files: dict[str, str], tmp: Path) -> list[str]:
    """Replaces container paths of mounted files in `argv` with copies under `tmp`."""
    out = []
    for word in argv:
        if word in files:
            local = tmp / word.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(files[word])
            word = str(local)
        out.append(word)
    return out


def run_cli(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """`rlfabric.cli.main(argv)` with exactly `env` as the process environment; (status, stdout, stderr)."""
    from rlfabric import cli

    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, env, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            status = cli.main(argv)
        except SystemExit as e:  # argparse: an unknown flag or a bad value
            status = int(e.code or 0)
    return status, out.getvalue(), err.getvalue()


def effective_config(argv: list[str], env: dict[str, str], where: str) -> dict[str, Any]:
    """The configuration `rlfabric serve ...` would run with (its --print-config), or a test failure."""
    assert argv[:1] == ["serve"], f"{where}: not a `serve` command: {argv}"
    status, out, err = run_cli([*argv, "--print-config"], env)
    assert status == 0, f"{where}: `rlfabric {' '.join(argv)}` is rejected:\n{err}{out}"
    return dict(json.loads(out))


def check_command(argv: list[str], env: dict[str, str], where: str) -> dict[str, Any] | None:
    """Runs an rlfabric command line through the CLI: `serve` loads its config (returned), `runs submit`
    validates its run file, anything else must parse."""
    if argv[:1] == ["serve"]:
        return effective_config(argv, env, where)
    from rlfabric import cli

    with mock.patch.dict(os.environ, env, clear=True):
        try:
            args = cli.build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `rlfabric {' '.join(argv)}` does not parse")
    if args.command == "runs" and args.verb == "submit":
        status, out, err = run_cli(["config", "check", "--schema-only", args.run_file], {})
        assert status == 0, f"{where}: run file {args.run_file} is invalid:\n{err}{out}"
    return None


def torchrun_target(argv: list[str]) -> tuple[Any, list[str]]:
    """Parses `torchrun ...` with torch's own parser; returns its options and the rlfabric argv it runs."""
    from torch.distributed.run import get_args_parser

    try:
        options = get_args_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"torchrun rejects its arguments: {argv}")
    assert options.module and options.training_script == "rlfabric.cli", (
        f"torchrun must run `-m rlfabric.cli`, got {options.training_script}"
    )
    return options, list(options.training_script_args)


def rlfabric_argv(container: Container) -> tuple[Any, list[str]]:
    """(torchrun options or None, the argv given to `rlfabric`)."""
    argv = container.argv()
    if argv[0] == "torchrun":
        return torchrun_target(argv)
    assert argv[0] == "rlfabric", f"{container.name}: runs {argv[0]!r}, not the rlfabric entry point"
    return None, argv[1:]
