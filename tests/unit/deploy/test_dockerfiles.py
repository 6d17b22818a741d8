"""The Dockerfiles, linted structurally (Docker is not needed and images are not built here): multi-stage
builds, a non-root final user, a health check, `rlfabric` as the entry point, installs that use extras
pyproject.toml defines, and COPY sources that exist and that .dockerignore lets into the context."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
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


def test_there_is_a_cpu_and_a_gpu_dockerfile() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.gpu"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_build(path: Path) -> None:
    built = stages(path)
    assert len(built) >= 2 and all(s.name for s in built), "every stage is named (FROM ... AS name)"
    names = [s.name for s in built]
    for stage in built:
        for copy in stage.all("COPY"):
            source = re.search(r"--from=(\S+)", copy)
            if source:
                assert source.group(1) in names[: names.index(stage.name)], f"COPY {copy}"
    final = built[-1]
    assert any("--from=" in c for c in final.all("COPY")), "the final stage copies the built environment"
    assert not any("pip install" in r for r in final.all("RUN")), "nothing is built in the final stage"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_rlfabric_as_a_non_root_user_with_a_health_check(path: Path) -> None:
    final = stages(path)[-1]
    users = final.all("USER")
    assert users, "the final stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]}"
    (entrypoint,) = final.all("ENTRYPOINT")
    assert exec_form(entrypoint) == ["rlfabric"]
    (healthcheck,) = final.all("HEALTHCHECK")
    assert "CMD" in healthcheck and "rlfabric-healthcheck" in healthcheck
    copies = " ".join(final.all("COPY"))
    assert "deploy/docker/healthcheck.py /usr/local/bin/rlfabric-healthcheck" in copies


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_pip_installs_use_extras_pyproject_defines(path: Path) -> None:
    extras = pyproject_extras()
    flavour = path.suffix.lstrip(".")
    installs = [r for s in stages(path) for r in s.all("RUN") if "pip install" in r]
    requested = {
        e for r in installs for group in re.findall(r'"?\.\[([a-z,]+)\]"?', r) for e in group.split(",")
    }
    assert requested == {flavour}, f"{path.name} installs extras {requested}"
    assert requested <= extras, f"extras missing from pyproject.toml: {requested - extras}"


def test_cpu_image_pins_the_torch_the_cpu_extra_wants() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pin,) = [d for d in data["project"]["optional-dependencies"]["cpu"] if d.startswith("torch")]
    text = (REPO / "deploy" / "docker" / "Dockerfile.cpu").read_text()
    assert f"pip install {pin} " in text


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
