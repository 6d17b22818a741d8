"""Configuration of the reward service process (`rlfabric serve reward`)."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import Field, field_validator

from rlfabric.runtime.config import StrictModel
from rlfabric.runtime.schema import LogConfig, ServerConfig

AllowEntryKind = Literal["module", "function", "directory"]
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_MODULE = re.compile(_DOTTED)
_FUNCTION = re.compile(f"{_DOTTED}:{_DOTTED}")


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


class SandboxConfig(StrictModel):
    """The server's limits for the code sandbox (`code_exec`). A request's params may only tighten them:
    a larger value, or `allow_unisolated` where the server disallows it, is INVALID_ARGUMENT."""

    cpu_s: int = Field(default=5, gt=0)
    """CPU-time limit per test process (RLIMIT_CPU), seconds."""
    wall_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit per test process, seconds; the process group is killed past it."""
    total_wall_s: float = Field(default=60.0, gt=0)
    """Wall-clock budget for all of one item's tests, seconds."""
    memory_mb: int = Field(default=512, gt=0)
    """Address-space limit per test process (RLIMIT_AS), MiB."""
    max_processes: int = Field(default=32, gt=0)
    """Process/thread limit (RLIMIT_NPROC) for the sandbox uid."""
    file_size_mb: int = Field(default=8, gt=0)
    """Largest file a program may write, stdout included (RLIMIT_FSIZE), MiB."""
    max_open_files: int = Field(default=64, gt=0)
    """Open file descriptor limit (RLIMIT_NOFILE)."""
    tmpfs_mb: int = Field(default=64, gt=0)
    """Size of a program's private /tmp (its working directory lives there), MiB."""
    allow_unisolated: bool = False
    """Whether a request may run code where network/pid/mount namespaces are unavailable (rlimits
    only): unsafe for untrusted code."""


class RewardServiceConfig(StrictModel):
    """The reward service: a batch scorer over gRPC."""

    server: ServerConfig = Field(default_factory=lambda: ServerConfig(port=50052))
    """gRPC server."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    item_timeout_s: float = Field(default=10.0, gt=0)
    """Default deadline per scored item when a request sets none."""
    max_batch_items: int = Field(default=4096, ge=1)
    """Largest batch accepted by Score; bigger ones get RESOURCE_EXHAUSTED."""
    max_item_bytes: int = Field(default=1 << 20, ge=1)
    """Largest single item (prompt + completion + reference + metadata); bigger gets RESOURCE_EXHAUSTED."""
    workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    """Scorer worker processes (CPU-heavy scorers run there, off the event loop); defaults to the cores.
    With several server `processes` they are shared out: each process gets ceil(workers / processes)."""
    processes: int = Field(default=1, ge=1, le=64)
    """Server processes sharing the port (SO_REUSEPORT, Linux): the kernel spreads client connections
    over them. One process handles RPCs on one core at most (gRPC's per-call work, the proto conversions
    and the inline scorers hold its GIL); raise this when cheap scorers at high call rates saturate it.
    Connections, not calls, are spread: a client reaches several processes only over several
    connections."""
    inline_scorers: list[str] = Field(
        default_factory=lambda: ["exact_match", "regex", "length_penalty", "overlong_penalty"]
    )
    """Cheap scorers run on a thread of the server process, where a process hop would cost more than the
    scoring itself."""
    token: str | None = Field(default=None, min_length=1)
    """Bearer token required on Score and ListScorers (health checks stay open); set it from
    RLFABRIC_REWARD__TOKEN. The process refuses to start without it unless `insecure`."""
    insecure: bool = False
    """Serve without credentials (`rlfabric serve reward --insecure`): `token` is no longer required at
    start (when set it is still enforced) and a WARNING is logged. For tests and loopback only: without a
    token anyone who reaches the port can run the scorers."""
    allowed_functions: list[str] = Field(default_factory=list)
    """Where user code (`python_function`) may be loaded from; empty (the default) allows none. Each
    entry is a module prefix "pkg.sub" (it and its submodules), one function "pkg.mod:attr", or a
    directory (an entry holding a "/") whose .py files may be loaded, symlinks and ".." resolved first.
    Anything else is refused with INVALID_ARGUMENT before any import."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """The code sandbox's limits; requests may only tighten them."""
    judge_api_keys: dict[str, str] = Field(default_factory=dict)
    """Environment variables an `llm_judge` request may name in `api_key_env`, each mapped to the base
    URL its key may be sent to (the request's `base_url` must be that URL or below it), e.g.
    {"JUDGE_API_KEY": "https://judge.internal/v1"}. Empty (the default): no request may use a key, so a
    caller cannot send this process's environment to a URL of its choosing."""

    @field_validator("allowed_functions")
    @classmethod
    def _known_entry_kinds(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            allow_entry_kind(entry)
        return entries
