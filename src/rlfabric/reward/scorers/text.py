"""Text helpers shared by the rule scorers: answer extraction, normalisation, completion length.

Pure functions over strings; no scorer state.
"""

from __future__ import annotations

import re
import string
import unicodedata
from typing import Literal

from rlfabric.reward.scorers.base import ItemError, ScoreInput

LengthUnit = Literal["auto", "tokens", "chars"]
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_tag(text: str, tag: str) -> str | None:
    """The content of the last `<tag>...</tag>` in `text`, or None when there is none."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1] if matches else None


def extract_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, braces balanced; else None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        content = _balanced(text, start)
        if content is not None:
            return content
    return None


def _balanced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace closing the one just before `start`; None if unclosed."""
    depth = 1
    for pos in range(start, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[start:pos]
    return None


def normalize(text: str, *, whitespace: bool, case: bool, punctuation: bool) -> str:
    """Unicode NFKC, then optionally collapse whitespace, lower-case and drop ASCII punctuation."""
    text = unicodedata.normalize("NFKC", text)
    if case:
        text = text.lower()
    if punctuation:
        text = text.translate(_PUNCT_TABLE)
    if whitespace:
        text = " ".join(text.split())
    return text


def extract_code(text: str, languages: tuple[str, ...] = ("python", "py", "python3", "")) -> str:
    """The last fenced code block in one of `languages` ("" = untagged); the whole text if none."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in languages]
    return blocks[-1] if blocks else text


def completion_length(item: ScoreInput, unit: LengthUnit) -> int:
    """Length of the completion: tokens from `metadata["completion_tokens"]` (a count or the token ids)
    or characters.

    "auto" uses the token count when the metadata has it and falls back to characters; "tokens" requires
    it (an `ItemError` otherwise, since a character count would silently change the scale).
    """
    tokens = item.metadata.get("completion_tokens")
    if unit == "chars" or (unit == "auto" and tokens is None):
        return len(item.completion)
    if tokens is None:
        raise ItemError("metadata has no 'completion_tokens' and the length unit is 'tokens'")
    if isinstance(tokens, list):
        return len(tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, int | float) or tokens < 0:
        raise ItemError(f"metadata 'completion_tokens' must be a non-negative number, got {tokens!r}")
    return int(tokens)
