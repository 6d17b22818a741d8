"""The Dockerfiles, linted structurally (Docker is not needed and images are not built here; CI's
container stage builds them, scripts/ci_containers.sh): multi-stage builds, a non-root final user, a
health check, `rlfabric` as the entry point, installs through install.sh with extras pyproject.toml
defines, no ignored errors and no remote frontend, and COPY sources that exist and that .dockerignore
lets into the context."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deploy_manifests import REPO

DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("Dockerfile.*"))


@dataclass
class Stage:
    """One build stage: its base, its name and its instructions (keyword, argument text)."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with line continuations joined and comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    found = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def stages(path: Path) -> list[Stage]:
    parsed: list[Stage] = []
    for keyword, rest in instructions(path.read_text()):
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            parsed.append(Stage(words[0], name))
        elif parsed:
            parsed[-1].instructions.append((keyword, rest))
    return parsed


def exec_form(text: str) -> list[str]:
    """An exec-form argument (JSON array), e.g. ENTRYPOINT ["rlfabric"]."""
    value = json.loads(text)
    assert isinstance(value, list), f"not exec form: {text}"
    return [str(v) for v in value]


def pyproject_extras() -> set[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(data["project"]["optional-dependencies"])


INSTALL = REPO / "deploy" / "docker" / "install.sh"


def test_there_is_a_light_a_cpu_and_a_gpu_dockerfile() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.light"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_no_remote_frontend_and_no_ignored_errors(path: Path) -> None:
    """A `# syntax=` line makes BuildKit pull a frontend image (offline builders cannot); `|| true` once
    hid a failed install behind "Successfully built"."""
    text = path.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE)
    for run in [r for s in stages(path) for r in s.all("RUN")]:
        assert "|| true" not in run and "|| :" not in run, run
    script = INSTALL.read_text()
    assert "set -euo pipefail" in script and "|| true" not in script


def install_targets() -> dict[str, list[str]]:
    """install.sh's flavour -> what it installs, from its `case` lines (`light) target=(...) ;;`)."""
    found = re.findall(r"^\s*(\w+)\) target=\(([^)]*)\) ;;", INSTALL.read_text(), re.MULTILINE)
    return {flavour: shlex.split(targets) for flavour, targets in found}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_installs_through_install_sh_with_extras_pyproject_defines(path: Path) -> None:
    flavour = path.suffix.lstrip(".")
    runs = [r for s in stages(path) for r in s.all("RUN")]
    steps = [f"rlfabric-install {flavour} {step}" for step in ("deps", "wheel", "package")]
    assert [r for r in runs if r.startswith("rlfabric-install")] == steps, f"{path.name} runs {runs}"
    assert not any("pip install" in r for r in runs), "installs go through install.sh"
    targets = install_targets()[flavour]
    requested = {
        e for t in targets for group in re.findall(r"\.\[([a-z0-9,]+)\]", t) for e in group.split(",")
    }
    if flavour != "light":
        assert flavour in requested, f"{flavour} installs {targets}"
    assert requested <= pyproject_extras(), f"extras missing from pyproject.toml: {requested}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_dependencies_layer_does_not_see_the_source(path: Path) -> None:
    """The dependencies install from pyproject.toml before any source is copied, and the final image
    copies that stage's environment whole: a change to src/ rebuilds the wheel and the last layers only,
    not gigabytes of torch and vLLM. The final stage installs the wheel and runs the install's checks."""
    flavour = path.suffix.lstrip(".")
    deps, wheel, runtime = stages(path)
    assert (deps.name, wheel.name, wheel.base) == ("deps", "wheel", "deps")
    copied = [w for copy in deps.all("COPY") for w in shlex.split(copy)[:-1]]
    assert "pyproject.toml" in copied and not any(w.startswith("src") or w == "README.md" for w in copied)
    assert f"rlfabric-install {flavour} deps" in deps.all("RUN")
    assert "src ./src" in wheel.all("COPY")
    assert runtime.all("COPY")[:2] == [
        "--from=deps /opt/rlfabric /opt/rlfabric",
        "--from=wheel /dist/ /dist/",
    ]
    assert runtime.all("RUN")[-1] == f"rlfabric-install {flavour} package"


def test_the_dependencies_are_pyprojects_own(tmp_path: Path) -> None:
    """install.sh's deps step installs what `pip install .[extras]` would: pyproject.toml's lists, read
    by its own Python (run here on the repository's pyproject.toml)."""
    script = INSTALL.read_text()
    function = script[
        script.index("requirements() {") : script.index("\n}\n", script.index("requirements() {")) + 2
    ]
    out = subprocess.run(
        ["bash", "-c", f'{function}\nrequirements "torch==2.13.0" ".[cpu,s3]"'],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = data["optional-dependencies"]
    assert out.stdout.split("\n")[:-1] == [
        "torch==2.13.0",
        *data["dependencies"],
        *extras["cpu"],
        *extras["s3"],
    ]


def test_cpu_image_pins_the_torch_the_cpu_extra_wants() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pin,) = [d for d in data["project"]["optional-dependencies"]["cpu"] if d.startswith("torch")]
    assert pin in install_targets()["cpu"]
    assert f"pip install {pin} --index-url" in INSTALL.read_text()  # the online path, from torch's index
    assert f'"{pin}"' in (REPO / "deploy" / "docker" / "wheelhouse.sh").read_text()


def dockerignore_allows(path: str) -> bool:
    """Whether .dockerignore (last matching rule wins, `!` re-includes) lets `path` into the context."""
    allowed = True
    for rule in (REPO / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
        if pattern == "**" or fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_exist_and_are_in_the_context(path: Path) -> None:
    for stage in stages(path):
        for copy in stage.all("COPY"):
            words = [w for w in shlex.split(copy) if not w.startswith("--")]
            if "--from=" in copy:
                continue
            for source in words[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                assert dockerignore_allows(source), f"COPY {source}: excluded by .dockerignore"
