"""Building the environment a service runs from its spec: one factory, called once per session.

A user class (`kind = "python"`) loads by reference under the operator's `allowed_functions`
(`runtime.user_code`: checked before any import); the built-in `ToolEnvironment` (`kind = "tools"`)
binds its tools once (user tools under the same allow-list) and shares them between sessions; an
environment written for TRL (`kind = "trl"`, `trl_env`) loads its factory the same way and calls it once
to check what it makes. Any failure is an `InvalidEnvironment` naming the field, raised when the service
starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfabric.environment.spec import (
    EnvironmentSpec,
    PythonEnvironmentSpec,
    ToolEnvironmentSpec,
    TrlEnvironmentSpec,
)
from rlfabric.environment.tool_env import ToolEnvironment
from rlfabric.environment.tools import InvalidTool, ToolBox
from rlfabric.environment.trl_env import NotTrlEnvironment, TrlEnvironment, TrlFactory
from rlfabric.runtime.config import ConfigError
from rlfabric.runtime.schema import SandboxConfig
from rlfabric.runtime.user_code import FunctionAllowlist, InvalidReference, load_reference

EnvironmentFactory = Callable[[], Any]
"""Makes one session's environment (an object with `reset` and `step`)."""


class InvalidEnvironment(ConfigError):
    """An environment spec that cannot be built; the message names the field."""


def environment_factory(
    spec: EnvironmentSpec, allowlist: FunctionAllowlist, sandbox: SandboxConfig
) -> EnvironmentFactory:
    """The factory of `spec`'s environment, its code loaded now."""
    if isinstance(spec, ToolEnvironmentSpec):
        toolbox = tool_box(spec, allowlist, sandbox)
        return lambda: ToolEnvironment(spec, toolbox)
    if isinstance(spec, TrlEnvironmentSpec):
        return trl_environment(spec, allowlist)
    return python_environment(spec, allowlist)


def tool_box(spec: ToolEnvironmentSpec, allowlist: FunctionAllowlist, sandbox: SandboxConfig) -> ToolBox:
    """The spec's tools, bound; `InvalidEnvironment` naming the tool that cannot be."""
    try:
        return ToolBox.build(
            spec.tools,
            allowlist,
            sandbox,
            parser=spec.tool_parser,
            max_calls=spec.max_tool_calls,
            max_chars=spec.max_output_chars,
        )
    except InvalidTool as exc:
        raise InvalidEnvironment(f"environment.tools: {exc}") from exc


def python_environment(spec: PythonEnvironmentSpec, allowlist: FunctionAllowlist) -> EnvironmentFactory:
    """The user class `spec.ref` (with `spec.kwargs`), checked to have `reset` and `step`."""
    try:
        cls = load_reference(spec.ref, allowlist)
    except InvalidReference as exc:
        raise InvalidEnvironment(f"environment.ref: {exc.reason}") from exc
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        what = f"lacks {' and '.join(missing)}" if missing else "is not a class"
        raise InvalidEnvironment(f"environment.ref: {spec.ref!r} {what} (see rlfabric.environment.base)")
    kwargs = dict(spec.kwargs)
    return lambda: cls(**kwargs)


def trl_environment(spec: TrlEnvironmentSpec, allowlist: FunctionAllowlist) -> EnvironmentFactory:
    """The TRL environment factory `spec.ref`, called once now to check what it makes (`trl_env`)."""
    try:
        factory = TrlFactory.probe(load_reference(spec.ref, allowlist), spec.ref)
    except (InvalidReference, NotTrlEnvironment) as exc:
        raise InvalidEnvironment(f"environment.ref: {exc}") from exc
    return lambda: TrlEnvironment(spec, factory)
