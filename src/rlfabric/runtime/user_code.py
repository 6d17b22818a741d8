"""User code loaded by reference, only where the operator allows it.

A request or a config names user code as `"package.module:attr"` (imported) or `"path/to/file.py:attr"`
(loaded from the file): the reward service's `python_function` scorers, the environment service's
environments and tools. Which code may load is the operator's decision (`allowed_functions`), never the
caller's:

1. the reference is checked as a string against the allowlist before anything is imported or any file
   is read, so a refused module's import-time code never runs;
2. attribute paths never pass through a private name ("_x") or into another module, and the object found
   must be defined where the allowlist allows (a function the allowed module merely imported, say
   `subprocess.run`, is refused), unless the entry names that exact reference.

Every refusal or failure to load is an `InvalidReference`; each service words it in its own terms.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

NOT_ALLOWED = "is not in allowed_functions"
AllowEntryKind = Literal["module", "function", "directory"]
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_MODULE = re.compile(_DOTTED)
_FUNCTION = re.compile(f"{_DOTTED}:{_DOTTED}")


class InvalidReference(ValueError):
    """A reference that is refused or cannot be loaded; `reason` says which and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def allow_entry_kind(entry: str) -> AllowEntryKind:
    """What an `allowed_functions` entry allows: a path (it holds a "/") is a directory, "pkg.mod:attr"
    one function, "pkg.sub" a module and its submodules; ValueError for anything else."""
    if "/" in entry:
        return "directory"
    if _FUNCTION.fullmatch(entry):
        return "function"
    if _MODULE.fullmatch(entry):
        return "module"
    raise ValueError(f"{entry!r} is neither a module ('pkg.sub'), a function ('pkg.mod:attr') nor a path")


@dataclass(frozen=True)
class FunctionAllowlist:
    """Parsed `allowed_functions`. Invariant: `directories` are absolute, symlinks and ".." resolved."""

    modules: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    directories: tuple[Path, ...] = ()

    @classmethod
    def parse(cls, entries: Sequence[str]) -> FunctionAllowlist:
        """Sorts entries by kind; ValueError for an entry that is none of them."""
        kinds: dict[str, list[str]] = {"module": [], "function": [], "directory": []}
        for entry in entries:
            kinds[allow_entry_kind(entry)].append(entry)
        dirs = tuple(Path(d).expanduser().resolve() for d in kinds["directory"])
        return cls(tuple(kinds["module"]), tuple(kinds["function"]), dirs)

    def entries(self) -> list[str]:
        """The parsed entries as strings again (directories resolved)."""
        return [*self.modules, *self.functions, *(str(d) for d in self.directories)]

    def check_module(self, module: str, attr: str) -> None:
        """Raises `InvalidReference` unless "module:attr" is allowed by a module prefix or exactly."""
        if f"{module}:{attr}" in self.functions or self.allows_module(module):
            return
        raise InvalidReference(f"{module + ':' + attr!r} {NOT_ALLOWED}")

    def allows_module(self, module: str) -> bool:
        """True when `module` is an allowed prefix or lies under one ("pkg" allows "pkg.x", not "pkgx")."""
        return any(module == prefix or module.startswith(prefix + ".") for prefix in self.modules)

    def check_file(self, target: str) -> Path:
        """The resolved path of the .py file `target` when it lies in an allowed directory (checked before
        the file is looked at, so a refusal says nothing about files elsewhere); else `InvalidReference`."""
        resolved = Path(target).expanduser().resolve()
        if not any(resolved.is_relative_to(d) for d in self.directories):
            raise InvalidReference(f"{target!r} {NOT_ALLOWED} (no allowed directory holds {str(resolved)!r})")
        if resolved.suffix != ".py" or not resolved.is_file():
            raise InvalidReference(f"no such file: {target!r}")
        return resolved

    def check_definition(self, obj: Any, reference: str, home: str) -> None:
        """Raises `InvalidReference` unless `obj` is defined in `home` (the module the reference named),
        under an allowed module prefix, or `reference` is an exact entry."""
        if reference in self.functions:
            return
        defined_in = getattr(obj, "__module__", None)
        if defined_in == home or (isinstance(defined_in, str) and self.allows_module(defined_in)):
            return
        raise InvalidReference(f"{reference!r} is defined in {defined_in!r}, which {NOT_ALLOWED}")


def check_attribute_path(attr: str) -> list[str]:
    """The parts of a dotted attribute path; `InvalidReference` for an empty or private part."""
    parts = attr.split(".")
    if any(not p or p.startswith("_") for p in parts):
        raise InvalidReference(f"attribute path {attr!r} goes through a private or empty name")
    return parts


def resolve_attribute(module: types.ModuleType, parts: Sequence[str], reference: str) -> Any:
    """`module.a.b...`; refuses to step into another module (`mod:os.system`)."""
    obj: Any = module
    for part in parts:
        obj = getattr(obj, part, None)
        if obj is None:
            raise InvalidReference(f"{reference!r}: no attribute {part!r}")
        if isinstance(obj, types.ModuleType):
            raise InvalidReference(f"{reference!r} goes through the module {obj.__name__!r}")
    return obj


def load_reference(reference: str, allowlist: FunctionAllowlist) -> Any:
    """The object "module:attr" or "file.py:attr" names, where the allowlist allows it; `InvalidReference`
    on any failure. Invariant: nothing is imported and no file is read before the allowlist said yes."""
    target, sep, attr = reference.rpartition(":")
    if not sep or not target or not attr:
        raise InvalidReference(f"expected 'module:attr' or 'path.py:attr', got {reference!r}")
    parts = check_attribute_path(attr)
    if target.endswith(".py"):
        module = _guarded_load(lambda: _load_file(allowlist.check_file(target)), target)
    else:
        allowlist.check_module(target, attr)
        module = _guarded_load(lambda: importlib.import_module(target), target)
    obj = resolve_attribute(module, parts, reference)
    allowlist.check_definition(obj, reference, module.__name__)
    return obj


def _guarded_load(load: Callable[[], types.ModuleType], target: str) -> types.ModuleType:
    """`load()` with every failure but a refusal turned into `InvalidReference`."""
    try:
        return load()
    except InvalidReference:
        raise
    except Exception as exc:
        raise InvalidReference(f"cannot load {target!r}: {type(exc).__name__}: {exc}") from exc


def _load_file(resolved: Path) -> types.ModuleType:
    """Imports the (allowed, resolved) file under a name derived from its path."""
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"rlfabric_user_code_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise InvalidReference(f"cannot import {str(resolved)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
