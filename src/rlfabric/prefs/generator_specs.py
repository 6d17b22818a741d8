"""What a pipeline file says of a text generator (`GeneratorSpec`): a running rollout replica, an
OpenAI-compatible endpoint, or a replica the build starts itself. Light: no grpc or httpx import.

Credentials never sit in a file: a spec names the environment variable that holds them (`token_env`,
`api_key_env`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator

from rlfabric.runtime.config import StrictModel

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_BODY_KEYS = frozenset(
    {"model", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "seed"}
)


def redact_url(url: str) -> str:
    """`url` without user:password, query or fragment (they can hold credentials)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _env_name(name: str | None) -> str | None:
    if name is not None and not ENV_NAME.fullmatch(name):
        raise ValueError("must be the NAME of the environment variable holding the credential, not its value")
    return name


class RolloutGeneratorSpec(StrictModel):
    """Completions from a rollout replica (`rlfabric serve rollout`) over its gRPC contract."""

    kind: Literal["rollout"] = "rollout"
    address: str
    """The replica's gRPC address, "host:port"."""
    token_env: str | None = None
    """Name of the environment variable holding a bearer token sent with every call; None: none."""
    model_version: int | None = Field(default=None, ge=0)
    """Pin the policy version: the replica must serve exactly this version (it waits for it, and a replica
    already past it is `GeneratorUnusable`); None takes whatever the replica serves and records it."""
    chat_template: bool = True
    """Send string prompts as one user message, rendered with the served model's chat template (as a run's
    `dataset.chat_template` does); false sends them as raw text. Chat prompts are always rendered."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables of the chat template, e.g. {enable_thinking = false}."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one Generate call."""
    batch_size: int = Field(default=16, ge=1)
    """Prompts per Generate call."""
    concurrency: int = Field(default=4, ge=1)
    """Generate calls in flight at once."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a call answered UNAVAILABLE or RESOURCE_EXHAUSTED, or with aborted samples."""
    backoff_s: float = Field(default=1.0, ge=0)
    """Wait before the first retry; doubles on each further retry."""

    @field_validator("address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be host:port, got {address!r}")
        return address

    _token_env = field_validator("token_env")(_env_name)


class OpenAIGeneratorSpec(StrictModel):
    """Completions from an OpenAI-compatible chat endpoint (`POST {base_url}/chat/completions`)."""

    kind: Literal["openai"] = "openai"
    base_url: str
    """The API root, including the version, e.g. "http://127.0.0.1:8000/v1"."""
    model: str = Field(min_length=1)
    """The model name sent in every request."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (sent as a Bearer token); None: no key."""
    timeout_s: float = Field(default=120.0, gt=0)
    """HTTP timeout of one request."""
    max_retries: int = Field(default=3, ge=0)
    """Retries after a transport error, 429 or 5xx (so at most max_retries + 1 attempts)."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubles on each further retry."""
    concurrency: int = Field(default=16, ge=1)
    """Requests in flight at once (one request per prompt, asking for all its completions)."""
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    """The request field that carries the token limit (OpenAI's reasoning models want the second)."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """More request fields, e.g. {top_p = 0.9} or vLLM's {chat_template_kwargs = {...}}."""

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"must be an http(s) URL, got {redact_url(url)!r}")
        return url

    @field_validator("extra_body")
    @classmethod
    def _no_reserved_keys(cls, body: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(RESERVED_BODY_KEYS & body.keys())
        if reserved:
            raise ValueError(f"{reserved} are set by the generator itself")
        return body

    _api_key_env = field_validator("api_key_env")(_env_name)


class LocalGeneratorSpec(StrictModel):
    """Completions from a rollout replica the build starts on loopback and stops when it is done
    (`rlfabric.prefs.local_replica`): sampling on a laptop with no fleet running."""

    kind: Literal["local"] = "local"
    model: str = Field(min_length=1)
    """Model folder (or hub id) the replica serves."""
    max_model_len: int = Field(default=2048, ge=16)
    """Longest prompt + completion in tokens."""
    max_tokens: int = Field(default=1024, ge=1)
    """Largest `max_tokens` the replica accepts."""
    kv_cache_bytes: int = Field(default=256 << 20, ge=1 << 20)
    """The replica's KV cache."""
    compile: bool = False
    """Compile the engine (faster sampling of large sets, about a minute longer to start)."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the replica to serve."""
    batch_size: int = Field(default=16, ge=1)
    """Prompts per Generate call."""
    concurrency: int = Field(default=4, ge=1)
    """Generate calls in flight at once."""


GeneratorSpec = Annotated[
    RolloutGeneratorSpec | OpenAIGeneratorSpec | LocalGeneratorSpec, Field(discriminator="kind")
]
"""Where completions come from: `kind = "rollout"` (a running replica), `"openai"` (an HTTP endpoint) or
`"local"` (a replica the build starts itself)."""
