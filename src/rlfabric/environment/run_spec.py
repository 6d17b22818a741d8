"""A run file's `[environment]` section: multi-turn rollouts against an environment service.

    [environment]                 # each sample is a trajectory played against this environment
    max_turns = 4
    max_total_tokens = 512

    [environment.service]         # the environment `rlfabric up` serves (the service's `environment`)
    kind = "tools"
    tools = [{ name = "calculator" }]

or `address = "host:port"` for an environment service already running (then `up` starts none, and the
replicas need its token as their `environment.token`). Plain pydantic: the run spec holds it without
importing any service.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, model_validator

from rlfabric.environment.spec import EnvironmentSpec, ToolEnvironmentSpec
from rlfabric.runtime.config import StrictModel


class RunEnvironmentSpec(StrictModel):
    """Multi-turn rollouts: the environment, and the limits of each trajectory."""

    service: EnvironmentSpec = Field(default_factory=ToolEnvironmentSpec)
    """The environment `rlfabric up` serves: `kind = "tools"` (the built-in tool environment),
    `kind = "python"` (a class with reset/step) or `kind = "trl"` (an environment written for TRL's
    `environment_factory`); user code only from the run file's folder or modules named here."""
    address: str | None = None
    """host:port of an environment service already running; `up` then starts none and `service` is
    that service's business."""
    max_turns: int = Field(default=4, ge=1, le=256)
    """Model turns per trajectory; reaching it before the environment is done truncates it."""
    max_total_tokens: int = Field(default=0, ge=0, le=1 << 20)
    """Tokens per trajectory after the prompt (model and environment turns together); 0 is up to
    model.max_model_len. `rollout.sampling.max_tokens` bounds each model turn."""
    step_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of each environment reset and step (the served environment's); past it the trajectory
    ends env_timeout and its group is dropped (counted), never scored as 0."""
    max_sessions: int = Field(default=1024, ge=1, le=1 << 20)
    """Sessions the served environment keeps open at once."""

    def allowed_functions(self, run_file: str | None) -> list[str]:
        """The served environment's `allowed_functions` under `rlfabric up`: the run file's folder and
        every reference the environment names by module (its class or factory, its tools' functions)."""
        folder = [str(Path(run_file).resolve().parent)] if run_file else []
        service = self.service
        refs = [(service.kind, getattr(service, "ref", None))]
        refs += [(tool.kind, tool.ref) for tool in getattr(service, "tools", [])]
        return folder + [ref for kind, ref in refs if ref and kind != "builtin" and ".py:" not in ref]

    @model_validator(mode="after")
    def _address_is_host_port(self) -> Self:
        if self.address is not None and ":" not in self.address:
            raise ValueError(f"environment.address: expected host:port, got {self.address!r}")
        return self
