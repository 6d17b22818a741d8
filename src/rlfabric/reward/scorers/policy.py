"""The operator's policy for scorers: which user code a request may load, and the sandbox's limits.

A request names user code by reference (`python_function`'s `function`) and asks for sandbox limits
(`code_exec`'s params). Both are the server's decision, never the caller's:

1. user code loads only from `allowed_functions` (`FunctionAllowlist`); the reference is checked as a
   string, before anything is imported or any file is read, so a refused module's import-time code
   never runs;
2. attribute paths never pass through a private name ("_x") or into another module, and the callable
   found must be defined where the allowlist allows (a function the allowed module merely imported,
   say `subprocess.run`, is refused), unless the entry names that exact function;
3. a request's sandbox limits may only tighten the server's (`tighten`); unset ones take the server's;
4. an `llm_judge` request may name an environment variable holding an API key only where
   `judge_api_keys` lists it, and may send it only to the base URL listed with it.

`build_scorer` hands the policy to every scorer it builds; the pool sends it to each worker process
first, so the workers build scorers under the same policy as the server process.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from rlfabric.reward.config import RewardServiceConfig, SandboxConfig, allow_entry_kind
from rlfabric.reward.scorers.base import InvalidScorerSpec

NOT_ALLOWED = "is not in allowed_functions"


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

    def check_module(self, module: str, attr: str) -> None:
        """Raises `InvalidScorerSpec` unless "module:attr" is allowed by a module prefix or exactly."""
        if f"{module}:{attr}" in self.functions or self.allows_module(module):
            return
        raise InvalidScorerSpec("function", f"{module + ':' + attr!r} {NOT_ALLOWED}")

    def allows_module(self, module: str) -> bool:
        """True when `module` is an allowed prefix or lies under one ("pkg" allows "pkg.x", not "pkgx")."""
        return any(module == prefix or module.startswith(prefix + ".") for prefix in self.modules)

    def check_file(self, target: str) -> Path:
        """The resolved path of the .py file `target` when it lies in an allowed directory (checked before
        the file is looked at, so a refusal says nothing about files elsewhere); else `InvalidScorerSpec`."""
        resolved = Path(target).expanduser().resolve()
        if not any(resolved.is_relative_to(d) for d in self.directories):
            raise InvalidScorerSpec(
                "function", f"{target!r} {NOT_ALLOWED} (no allowed directory holds {str(resolved)!r})"
            )
        if resolved.suffix != ".py" or not resolved.is_file():
            raise InvalidScorerSpec("function", f"no such file: {target!r}")
        return resolved

    def check_definition(self, fn: Any, reference: str, home: str) -> None:
        """Raises `InvalidScorerSpec` unless `fn` is defined in `home` (the module the reference named),
        under an allowed module prefix, or `reference` is an exact entry."""
        if reference in self.functions:
            return
        defined_in = getattr(fn, "__module__", None)
        if defined_in == home or (isinstance(defined_in, str) and self.allows_module(defined_in)):
            return
        raise InvalidScorerSpec(
            "function", f"{reference!r} is defined in {defined_in!r}, which {NOT_ALLOWED}"
        )


@dataclass(frozen=True)
class ScorerPolicy:
    """What the server allows scorers: `allowed_functions` entries and the sandbox's limits. The default
    allows no user code and the default sandbox, with isolation required."""

    allowed_functions: tuple[str, ...] = ()
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    judge_api_keys: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: RewardServiceConfig) -> ScorerPolicy:
        """The policy of a service config, its directories resolved against this process's cwd."""
        allowlist = FunctionAllowlist.parse(config.allowed_functions)
        entries = [*allowlist.modules, *allowlist.functions, *(str(d) for d in allowlist.directories)]
        return cls(tuple(entries), config.sandbox, dict(config.judge_api_keys))

    @cached_property
    def allowlist(self) -> FunctionAllowlist:
        return FunctionAllowlist.parse(self.allowed_functions)

    def to_json(self) -> dict[str, Any]:
        return {
            "allowed_functions": list(self.allowed_functions),
            "sandbox": self.sandbox.model_dump(),
            "judge_api_keys": dict(self.judge_api_keys),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScorerPolicy:
        sandbox = SandboxConfig.model_validate(data["sandbox"])
        return cls(tuple(data["allowed_functions"]), sandbox, dict(data.get("judge_api_keys", {})))

    def check_api_key(self, env: str, base_url: str) -> None:
        """Raises `InvalidScorerSpec` unless `judge_api_keys` lets the key in `env` go to `base_url`."""
        home = self.judge_api_keys.get(env)
        if home is None:
            raise InvalidScorerSpec("api_key_env", f"{env!r} is not in the server's judge_api_keys")
        url, home = base_url.rstrip("/"), home.rstrip("/")
        if url != home and not url.startswith(home + "/"):
            reason = f"the key in {env!r} may only be sent to {home!r} (judge_api_keys), not {base_url!r}"
            raise InvalidScorerSpec("base_url", reason)


def check_attribute_path(attr: str) -> list[str]:
    """The parts of a dotted attribute path; `InvalidScorerSpec` for an empty or private part."""
    parts = attr.split(".")
    private = [p for p in parts if not p or p.startswith("_")]
    if private:
        raise InvalidScorerSpec("function", f"attribute path {attr!r} goes through a private or empty name")
    return parts


def resolve_attribute(module: types.ModuleType, parts: Sequence[str], reference: str) -> Any:
    """`module.a.b...`; refuses to step into another module (`mod:os.system`)."""
    obj: Any = module
    for part in parts:
        obj = getattr(obj, part, None)
        if obj is None:
            raise InvalidScorerSpec("function", f"{reference!r}: no attribute {part!r}")
        if isinstance(obj, types.ModuleType):
            raise InvalidScorerSpec("function", f"{reference!r} goes through the module {obj.__name__!r}")
    return obj


def tighten(server: SandboxConfig, requested: Mapping[str, Any]) -> SandboxConfig:
    """The server's limits with each requested value that is set (not None) in place; a value above the
    server's limit, or `allow_unisolated` the server disallows, raises `InvalidScorerSpec` naming it."""
    values = {name: value for name, value in requested.items() if value is not None}
    for name, value in values.items():
        limit = getattr(server, name)
        if name == "allow_unisolated" and value and not limit:
            raise InvalidScorerSpec(
                name, "the server does not allow running code without isolation (sandbox.allow_unisolated)"
            )
        if value > limit:
            raise InvalidScorerSpec(name, f"{value} exceeds the server's limit (sandbox.{name} = {limit})")
    return server.model_copy(update=values)
