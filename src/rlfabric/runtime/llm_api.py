"""Asking an LLM over an OpenAI-compatible chat API: prompt templates, the request with retries, the answer.

Shared by the reward service's `llm_judge` scorer and the preference pipeline's generators and judges
(`rlfabric.prefs`), so that both fill templates, retry and read answers the same way:

- `fill_template` replaces only the named `{placeholders}`: other braces (a JSON example in a rubric) are
  kept, and a value that itself contains `{name}` is never filled again.
- `ChatEndpoint.complete` POSTs one body to `{base_url}/chat/completions` and retries transport errors,
  429 and 5xx with exponential backoff (`backoff_s`, doubling) up to `max_retries` times. A request that
  still fails, a 4xx, or an answer that is not JSON raises `ChatApiError` with the last HTTP status.
- `choice_texts` reads the message texts of an answer's choices, in `index` order.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

ERROR_TEXT_CHARS = 200
"""How much of an error answer's body an error message quotes."""


class ChatApiError(Exception):
    """A chat completion request that failed for good. `status` is the HTTP status of the last answer:
    None after a transport error, or for a 2xx answer that is not a chat completion."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Retryable(ChatApiError):
    """A failed attempt worth retrying: a transport error, 429 or 5xx."""


def fill_template(template: str, values: Mapping[str, str]) -> str:
    """`template` with each `{name}` for a name in `values` replaced in one pass; other braces are kept."""
    if not values:
        return template
    names = "|".join(re.escape(name) for name in values)
    return re.sub(rf"\{{({names})\}}", lambda m: values[m.group(1)], template)


def chat_url(base_url: str) -> str:
    """The chat completions URL under an API root such as "http://judge:8000/v1"."""
    return base_url.rstrip("/") + "/chat/completions"


@dataclass(frozen=True)
class ChatEndpoint:
    """An OpenAI-compatible chat completions endpoint and how to retry it."""

    base_url: str
    """The API root, including the version, e.g. "http://judge:8000/v1"."""
    api_key: str | None = None
    """Sent as a Bearer token; None: no Authorization header."""
    max_retries: int = 3
    """Retries after a transport error, 429 or 5xx (so at most max_retries + 1 attempts)."""
    backoff_s: float = 0.5
    """Wait before the first retry; doubles on each further retry."""

    @property
    def url(self) -> str:
        return chat_url(self.base_url)

    def headers(self) -> dict[str, str]:
        """The headers of every request (the key included): give them to the `httpx.AsyncClient`."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    async def complete(self, client: httpx.AsyncClient, body: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON answer to one chat completion request, after retries; ChatApiError when it failed."""
        response = await self._post_with_retries(client, body)
        try:
            payload = response.json()
        except ValueError as exc:
            raise ChatApiError(f"answer is not JSON: {response.text[:300]!r}", response.status_code) from exc
        if not isinstance(payload, dict):
            raise ChatApiError(f"answer is not a JSON object: {response.text[:300]!r}", response.status_code)
        return payload

    async def _post_with_retries(self, client: httpx.AsyncClient, body: Mapping[str, Any]) -> httpx.Response:
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            try:
                return await self._post_once(client, body)
            except _Retryable as exc:
                last = exc
            if attempt + 1 < attempts:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise ChatApiError(f"request failed after {attempts} attempt(s): {last}", last.status)

    async def _post_once(self, client: httpx.AsyncClient, body: Mapping[str, Any]) -> httpx.Response:
        try:
            response = await client.post(self.url, json=body)
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status == 429 or status >= 500:
            raise _Retryable(f"HTTP {status}: {response.text[:ERROR_TEXT_CHARS]!r}", status)
        if status >= 400:
            raise ChatApiError(
                f"endpoint answered HTTP {status}: {response.text[:ERROR_TEXT_CHARS]!r}", status
            )
        return response


def choice_texts(payload: Mapping[str, Any]) -> list[str]:
    """The message text of each choice of a chat completion, in `index` order (a null content is "")."""
    try:
        choices = sorted(payload["choices"], key=lambda c: int(c.get("index", 0)))
        return [str(c["message"].get("content") or "") for c in choices]
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ChatApiError(f"malformed chat completion: {str(payload)[:300]!r}") from exc
