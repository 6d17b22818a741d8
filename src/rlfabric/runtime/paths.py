"""Confining the paths a run spec names to the folders the operator allows (its roots).

A run spec comes from whoever holds the API token; the files it names are read by the service that
receives it. Each path must lie in one of the service's roots after `Path.resolve()`, so `..` and
symlinks count. Relative paths and roots are taken from the process's working directory, where the
services open them. The check never asks whether the file exists: a refusal says only that the path
is outside the roots, so it cannot be used to probe the file system.

A model or a dataset may also be a hub id (`org/name`, nothing before the org, no `..`): transformers,
vLLM and `datasets` load it from the hub (cache). A local folder of that name would be loaded instead,
so a hub id whose resolved path differs from its plain absolute path (a symlink on the way) must lie in
the roots too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlfabric.runspec import PathKind, RunSpec

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""A hub repository id, `org/name`: neither part starts with `.`, so neither is `.` or `..`."""


@dataclass(frozen=True)
class Roots:
    """The resolved folders each kind of path must lie in (an empty list allows no local path)."""

    data: tuple[Path, ...]
    model: tuple[Path, ...]

    @classmethod
    def of(cls, data: Iterable[str], model: Iterable[str]) -> Roots:
        """Roots from configured folder names, resolved now (relative ones against the working dir)."""
        return cls(resolve_all(data), resolve_all(model))

    def for_kind(self, kind: PathKind) -> tuple[Path, ...]:
        return self.data if kind == "data" else self.model


@dataclass(frozen=True)
class PathViolation:
    """A spec field whose path lies outside its roots; `message` says so without naming the file or
    whether it exists."""

    field: str
    kind: PathKind

    @property
    def message(self) -> str:
        return f"the path is outside the folders this service allows for it ({self.kind}_roots)"


def resolve_all(folders: Iterable[str]) -> tuple[Path, ...]:
    return tuple(Path(folder).resolve() for folder in folders)


def within(path: str, roots: Sequence[Path]) -> bool:
    """True when `path`, resolved (`..` and symlinks followed), is one of `roots` or lies below one. A
    path that cannot be resolved (a NUL byte, a symlink loop) is outside."""
    try:
        resolved = Path(path).resolve()
    except (ValueError, OSError, RuntimeError):
        return False
    return any(resolved.is_relative_to(root) for root in roots)


def is_hub_id(path: str) -> bool:
    """True for `org/name` that no symlink on the local path of that name redirects."""
    if not HUB_ID.match(path):
        return False
    local = Path(path)
    try:
        return local.resolve() == local.absolute()
    except (OSError, RuntimeError):
        return False


def allowed(path: str, kind: PathKind, roots: Roots) -> bool:
    """True when a spec may name `path` as a `kind`: within its roots, or a hub id (a model, or a
    dataset loaded with `datasets.load_dataset`)."""
    return within(path, roots.for_kind(kind)) or is_hub_id(path)


def violations(spec: RunSpec, roots: Roots) -> list[PathViolation]:
    """The spec's paths (see `RunSpec.local_paths`) that lie outside their roots, in field order."""
    return [
        PathViolation(field, kind)
        for field, (kind, path) in spec.local_paths().items()
        if not allowed(path, kind, roots)
    ]
