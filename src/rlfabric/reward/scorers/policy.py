"""The operator's policy for scorers: which user code a request may load, and the sandbox's limits.

A request names user code by reference (`python_function`'s `function`) and asks for sandbox limits
(`code_exec`'s params). Both are the server's decision, never the caller's:

1. user code loads only from `allowed_functions`, under the rules of `rlfabric.runtime.user_code`
   (shared with the environment service): the reference is checked as a string before any import, never
   passes through a private name or another module, and the callable must be defined where allowed;
2. a request's sandbox limits may only tighten the server's (`tighten`); unset ones take the server's;
3. an `llm_judge` request may name an environment variable holding an API key only where
   `judge_api_keys` lists it, and may send it only to the base URL listed with it.

`build_scorer` hands the policy to every scorer it builds; the pool sends it to each worker process
first, so the workers build scorers under the same policy as the server process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from rlfabric.reward.config import RewardServiceConfig
from rlfabric.reward.scorers.base import InvalidScorerSpec
from rlfabric.runtime.schema import SandboxConfig
from rlfabric.runtime.user_code import FunctionAllowlist


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
        entries = FunctionAllowlist.parse(config.allowed_functions).entries()
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
