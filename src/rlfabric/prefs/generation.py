"""Text generators: `n` completions per prompt from a rollout replica (gRPC) or an OpenAI-compatible chat
endpoint, for sampling candidate answers, asking an LLM judge and critique-revise chains.

A pipeline file names a generator with a `GeneratorSpec` (`generator_specs`: `kind = "rollout"`, `"openai"`
or `"local"`, a replica the build starts: `local_replica`);
`make_generator` builds it. Both kinds implement `types.TextGenerator` and, through `Generator`, also
`generate_each`, which reports a failed prompt as a `GenerationError` in its place instead of raising, so
that a judge turns one failed request into one "error" judgement.

Failures, and what is retried:
1. Transient ones are retried with exponential backoff (`max_retries`, `backoff_s`): for a replica
   UNAVAILABLE (no weights yet, draining), RESOURCE_EXHAUSTED (admission limit) and samples aborted by a
   weight update; for an OpenAI endpoint transport errors, 429 and 5xx (`rlfabric.runtime.llm_api`).
2. A prompt the endpoint refuses (a replica's INVALID_ARGUMENT, e.g. too long; an HTTP 400), or a request
   still failing after its retries, is a `GenerationError` for the prompts it carried. A replica batch
   refused as a whole is re-asked prompt by prompt, so only the offending prompt fails.
3. `GeneratorUnusable` means no request can succeed: a credential missing or refused, an unknown model or
   path (401/403/404, UNAUTHENTICATED), sampling settings a replica refuses (`sampling.max_tokens` over
   its limit), a replica serving another version than the pinned `model_version`.
   It is raised, never returned per prompt.

Credentials never sit in a file: a spec names the environment variable that holds them (`token_env`,
`api_key_env`) and `describe()` (what the dataset manifest records) leaves them, and any user:password or
query string of a URL, out.

Seeds: with `seed` set, prompt i's samples are seeded from `seed + i * n` on, so a seeded result does not
depend on how prompts are batched into requests.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
import httpx

from rlfabric.contracts import wire
from rlfabric.prefs.generator_specs import (
    GeneratorSpec,
    LocalGeneratorSpec,
    OpenAIGeneratorSpec,
    RolloutGeneratorSpec,
    redact_url,
)
from rlfabric.prefs.types import Prompt
from rlfabric.runtime.grpc_client import make_channel
from rlfabric.runtime.llm_api import ChatApiError, ChatEndpoint, choice_texts
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

T = TypeVar("T")
INFO_REQUEST = rollout_pb2.GetInfoRequest()
UNUSABLE_HTTP = frozenset({401, 403, 404})
"""HTTP answers that mean no request to this endpoint can succeed (credential, model or path wrong)."""
UNUSABLE_GRPC = frozenset(
    {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}
)
RETRIED_GRPC = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class GenerationError(Exception):
    """A generation request that failed for good: the prompts it carried have no completions."""


class GeneratorUnusable(Exception):
    """The generator cannot work at all (credential, model, address or pinned version wrong)."""


Outcome = list[str] | GenerationError
"""What `generate_each` gives for one prompt: its `n` completions, or why it has none."""


def read_credential(env_name: str | None, field: str) -> str | None:
    """The value of the environment variable `env_name` (None when no variable is named)."""
    if env_name is None:
        return None
    value = os.environ.get(env_name)
    if not value:
        raise GeneratorUnusable(f"{field}: environment variable {env_name!r} is not set")
    return value


def check_sampling(n: int, max_tokens: int, temperature: float) -> None:
    if n < 1 or max_tokens < 1 or not temperature >= 0:
        raise ValueError(
            f"need n >= 1, max_tokens >= 1, temperature >= 0; got {n}, {max_tokens}, {temperature}"
        )


def prompt_seed(seed: int | None, index: int, n: int) -> int | None:
    """The seed of prompt `index`'s first sample (its k-th sample is seeded from this + k)."""
    return None if seed is None else seed + index * n


class Generator(ABC):
    """A `TextGenerator` that can also report failures prompt by prompt (`generate_each`)."""

    @abstractmethod
    async def generate_each(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[Outcome]:
        """One `Outcome` per prompt, in order: `n` texts, or the `GenerationError` that left it without."""

    async def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[list[str]]:
        """`n` completions of each prompt, in order; the first failed prompt raises its GenerationError."""
        outcomes = await self.generate_each(
            prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed
        )
        texts: list[list[str]] = []
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, GenerationError):
                raise GenerationError(f"prompts[{index}]: {outcome}") from outcome
            texts.append(outcome)
        return texts

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the manifest records: kind, model, version, endpoint (no credential)."""

    @abstractmethod
    async def close(self) -> None:
        """Release channels and clients; the generator reconnects if used again."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class _Refused(GenerationError):
    """The replica refused the request's prompts (INVALID_ARGUMENT): one of them, maybe not all."""


class _Retry(GenerationError):
    """A call worth repeating: the replica was unavailable or full, or a weight update aborted samples."""


class RolloutGenerator(Generator):
    """Generates through a rollout replica's `Generate` RPC, `batch_size` prompts per call. The bearer token
    sent (the replica's `client_token`) is `token` when given (a replica this process started itself),
    else the value of `spec.token_env`."""

    def __init__(self, spec: RolloutGeneratorSpec, *, token: str | None = None) -> None:
        self.spec = spec
        self._token = token or read_credential(spec.token_env, "token_env")
        self._channel: grpc.aio.Channel | None = None
        self._info: rollout_pb2.ReplicaInfo | None = None
        self._versions: set[int] = set()
        self._limit = asyncio.Semaphore(spec.concurrency)
        self._ids = (f"prefs-{uuid.uuid4().hex[:12]}-{i}" for i in itertools.count())

    def _stub(self) -> rollout_pb2_grpc.RolloutServiceStub:
        if self._channel is None:
            self._channel = make_channel(
                self.spec.address, bearer_token=self._token, default_timeout_s=self.spec.timeout_s
            )
        return rollout_pb2_grpc.RolloutServiceStub(self._channel)

    async def generate_each(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[Outcome]:
        check_sampling(n, max_tokens, temperature)
        if self._info is None:
            self._info = await self._replica_info()
        sampling = rollout_pb2.SamplingParams(n=n, temperature=temperature, top_p=1.0, max_tokens=max_tokens)
        protos = [self._prompt_proto(p) for p in prompts]
        starts = range(0, len(protos), self.spec.batch_size)
        chunks = [list(range(i, min(i + self.spec.batch_size, len(protos)))) for i in starts]
        results = await asyncio.gather(*(self._chunk(protos, chunk, sampling, seed) for chunk in chunks))
        return [outcome for result in results for outcome in result]

    def _prompt_proto(self, prompt: Prompt) -> common_pb2.Prompt:
        """The prompt as the coordinator sends it (`wire.prompt_to_proto`): the replica renders chat
        messages (and, with `chat_template`, a string as one user message) with the model's template."""
        return wire.prompt_to_proto(
            prompt, chat_template=self.spec.chat_template, template_kwargs=self.spec.chat_template_kwargs
        )

    async def _chunk(
        self,
        protos: list[common_pb2.Prompt],
        indices: list[int],
        sampling: rollout_pb2.SamplingParams,
        seed: int | None,
    ) -> list[Outcome]:
        """The outcomes of `protos[indices]` from one call; a refused batch is re-asked prompt by prompt."""
        async with self._limit:
            try:
                return await self._with_retries(lambda: self._generate_once(protos, indices, sampling, seed))
            except _Refused as exc:
                if len(indices) == 1:
                    return [GenerationError(str(exc))]
            except GenerationError as exc:
                return [exc for _ in indices]
        singles = await asyncio.gather(*(self._chunk(protos, [i], sampling, seed) for i in indices))
        return [single[0] for single in singles]

    async def _replica_info(self) -> rollout_pb2.ReplicaInfo:
        """The replica's GetInfo (its model, for `describe`); a replica that never answers is unusable."""
        try:
            return await self._with_retries(lambda: self._call(lambda stub: stub.GetInfo(INFO_REQUEST)))
        except GenerationError as exc:
            raise GeneratorUnusable(str(exc)) from None

    async def _with_retries(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()`, repeated with exponential backoff while it raises `_Retry`."""
        attempts = self.spec.max_retries + 1
        for number in range(attempts):
            try:
                return await attempt()
            except _Retry as exc:
                last = exc
            if number + 1 < attempts:
                await asyncio.sleep(self.spec.backoff_s * 2**number)
        raise GenerationError(f"{self.spec.address}: failed after {attempts} attempt(s): {last}")

    async def _generate_once(
        self,
        protos: list[common_pb2.Prompt],
        indices: list[int],
        sampling: rollout_pb2.SamplingParams,
        seed: int | None,
    ) -> list[Outcome]:
        """One Generate call for `protos[indices]`: each prompt's `n` texts, by (prompt, sample) index."""
        request = rollout_pb2.GenerateRequest(
            request_id=next(self._ids),
            prompts=[rollout_pb2.GeneratePrompt(prompt_id=str(i), prompt=protos[i]) for i in indices],
            sampling=sampling,
            min_policy_version=self.spec.model_version or 0,
        )
        first_seed = prompt_seed(seed, indices[0], sampling.n)
        if first_seed is not None:
            request.sampling.seed = first_seed
        samples = await self._call(lambda stub: _collect(stub.Generate(request)))
        return self._texts(samples, len(indices), sampling.n)

    def _texts(self, samples: list[rollout_pb2.GeneratedSample], prompts: int, n: int) -> list[Outcome]:
        texts: list[list[str | None]] = [[None] * n for _ in range(prompts)]
        for s in samples:
            if wire.finish_reason_from_proto(s.finish_reason) == "abort":
                raise _Retry("a weight update aborted the request's samples")
            self._check_version(s.policy_version)
            texts[s.prompt_index][s.sample_index] = s.text
        if any(t is None for row in texts for t in row):
            raise GenerationError(f"{self.spec.address}: {len(samples)} of {prompts * n} samples came back")
        return [[t or "" for t in row] for row in texts]

    def _check_version(self, version: int) -> None:
        pinned = self.spec.model_version
        if pinned is not None and version != pinned:
            raise GeneratorUnusable(
                f"{self.spec.address} serves policy version {version}, the spec pins model_version {pinned}"
            )
        self._versions.add(version)

    async def _call(self, call: Any) -> Any:
        """`call(stub)`, with gRPC failures sorted: unusable, worth retrying, refused, or failed."""
        try:
            return await call(self._stub())
        except grpc.aio.AioRpcError as exc:
            code, message = exc.code(), f"{self.spec.address}: {exc.code().name}: {exc.details()}"
            if code in UNUSABLE_GRPC:
                raise GeneratorUnusable(message) from None
            if code in RETRIED_GRPC:
                raise _Retry(message) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                if (exc.details() or "").startswith("sampling."):  # no prompt can run with these settings
                    raise GeneratorUnusable(message) from None
                raise _Refused(message) from None
            raise GenerationError(message) from None

    def describe(self) -> dict[str, Any]:
        info = self._info
        return {
            "kind": "rollout",
            "address": self.spec.address,
            "model": info.model if info else None,
            "engine": info.engine if info else None,
            "replica_id": info.replica_id if info else None,
            "model_version": self.spec.model_version,
            "policy_versions": sorted(self._versions),
            "chat_template": self.spec.chat_template,
            "chat_template_kwargs": self.spec.chat_template_kwargs,
        }

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None


async def _collect(stream: Any) -> list[rollout_pb2.GeneratedSample]:
    return [sample async for sample in stream]


class OpenAIGenerator(Generator):
    """Generates through `POST {base_url}/chat/completions`: one request per prompt asks for its `n`
    completions (a server that returns fewer is asked again for the rest). String prompts are sent as one
    user message, chat prompts as they are."""

    def __init__(
        self, spec: OpenAIGeneratorSpec, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.spec = spec
        key = read_credential(spec.api_key_env, "api_key_env")
        self.endpoint = ChatEndpoint(spec.base_url, key, spec.max_retries, spec.backoff_s)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._limit = asyncio.Semaphore(spec.concurrency)
        self._served: set[str] = set()
        self._fingerprints: set[str] = set()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.spec.timeout_s, headers=self.endpoint.headers(), transport=self._transport
            )
        return self._client

    async def generate_each(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[Outcome]:
        check_sampling(n, max_tokens, temperature)
        body = {"model": self.spec.model, self.spec.max_tokens_field: max_tokens, "temperature": temperature}
        body |= self.spec.extra_body
        asks = (self._prompt(p, body, n, prompt_seed(seed, i, n)) for i, p in enumerate(prompts))
        return list(await asyncio.gather(*asks))

    async def _prompt(self, prompt: Prompt, body: dict[str, Any], n: int, seed: int | None) -> Outcome:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        texts: list[str] = []
        async with self._limit:
            try:
                while len(texts) < n:
                    k = len(texts)
                    got = await self._request({**body, "messages": messages, "n": n - k}, seed, k)
                    if not got:
                        raise GenerationError("the chat completion has no choices")
                    texts += got
            except GenerationError as exc:
                return exc
        return texts[:n]

    async def _request(self, body: dict[str, Any], seed: int | None, offset: int) -> list[str]:
        if seed is not None:
            body["seed"] = seed + offset
        try:
            payload = await self.endpoint.complete(self._http(), body)
            texts = choice_texts(payload)
        except ChatApiError as exc:
            if exc.status in UNUSABLE_HTTP:
                raise GeneratorUnusable(f"{redact_url(self.endpoint.url)}: {exc}") from None
            raise GenerationError(str(exc)) from None
        self._record(payload)
        return texts

    def _record(self, payload: dict[str, Any]) -> None:
        """Keeps what the answer says of the model that served it (for `describe`)."""
        if isinstance(payload.get("model"), str):
            self._served.add(payload["model"])
        if isinstance(payload.get("system_fingerprint"), str):
            self._fingerprints.add(payload["system_fingerprint"])

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "openai",
            "base_url": redact_url(self.spec.base_url),
            "model": self.spec.model,
            "served_models": sorted(self._served),
            "system_fingerprints": sorted(self._fingerprints),
            "extra_body": self.spec.extra_body,
        }

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def make_generator(spec: GeneratorSpec) -> Generator:
    """The generator a spec describes; `GeneratorUnusable` when its credential's variable is not set."""
    if isinstance(spec, RolloutGeneratorSpec):
        return RolloutGenerator(spec)
    if isinstance(spec, LocalGeneratorSpec):
        from rlfabric.prefs.local_replica import LocalGenerator  # starts processes: only when asked

        return LocalGenerator(spec)
    return OpenAIGenerator(spec)
