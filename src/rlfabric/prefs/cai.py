"""Constitutional AI critique-revise chains: a model critiques an answer under each principle in turn and
revises it given its critique; the final revision is preferred over the original.

Each principle's turn is a conversation, as in Bai et al. (2022), so the model's chat template frames it:

    critique prompt = the prompt's messages + [assistant: current answer, user: critique request]
    revision prompt = critique prompt + [assistant: critique, user: revision request]

The revision becomes the current answer of the next principle. The requests are the principle's
`critique` and `revision` templates with {prompt} (as text), {answer} (the current answer) and, in the
revision, {critique} filled in; other braces are kept. Every step keeps the exact prompts and outputs
(`types.CritiqueStep`). Rows go through each step together: the generator sees one batch per step, two
per principle. A generation failure raises (`generation.GenerationError`): the chain is all or nothing.

A principles file (TOML, YAML or JSON) is a list of principles: `[[principles]]` tables in TOML, a list
or a `principles:` key in YAML and JSON. examples/rlhf/principles.toml is a small generic set.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, TypeAdapter, ValidationError, field_validator

from rlfabric.prefs.llm_judge import prompt_text
from rlfabric.prefs.types import CaiChain, CritiqueStep, Prompt, TextGenerator
from rlfabric.runtime.config import ConfigError, StrictModel, yaml_load
from rlfabric.runtime.llm_api import fill_template

Message = dict[str, Any]


class Principle(StrictModel):
    """One principle of a constitution: how to ask for a critique under it, and for a revision."""

    name: str = Field(min_length=1)
    """How chains and reports name the principle (unique within a file)."""
    critique: str = Field(min_length=1)
    """The critique request, sent after the answer; {prompt} and {answer} are filled in."""
    revision: str = Field(min_length=1)
    """The revision request, sent after the critique; {prompt}, {answer} and {critique} are filled in."""

    @field_validator("critique")
    @classmethod
    def _no_critique_yet(cls, template: str) -> str:
        if "{critique}" in template:
            raise ValueError("{critique} is only known in the revision request")
        return template


_PRINCIPLES = TypeAdapter(list[Principle])


def load_principles(path: str | Path) -> list[Principle]:
    """The principles of a TOML/YAML/JSON file; `ConfigError` naming the file and the field otherwise."""
    file = Path(path)
    items = _principle_list(file, _read(file))
    try:
        principles = _PRINCIPLES.validate_python(items)
    except ValidationError as exc:
        raise ConfigError(f"{file}: invalid principles:\n{_field_errors(exc)}") from None
    seen: dict[str, int] = {}
    for index, principle in enumerate(principles):
        if principle.name in seen:
            first = seen[principle.name]
            raise ConfigError(
                f"{file}: principles[{index}].name: {principle.name!r} repeats principles[{first}]"
            )
        seen[principle.name] = index
    return principles


def _read(file: Path) -> Any:
    if not file.is_file():
        raise ConfigError(f"principles file not found: {file}")
    text, suffix = file.read_text(), file.suffix.lower()
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            return yaml_load(text)
        if suffix == ".json":
            return json.loads(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: not valid {suffix.lstrip('.')}: {exc}") from None
    raise ConfigError(f"{file}: unsupported format {suffix!r}: use .toml, .yaml, .yml or .json")


def _principle_list(file: Path, data: Any) -> list[Any]:
    """The list of principles of a file's data: the data itself, or its `principles` key."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"principles"})
        if unknown:
            raise ConfigError(f"{file}: {unknown[0]}: unknown key (the file holds `principles`)")
        data = data.get("principles")
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{file}: principles: expected a non-empty list of principles")
    return data


def _field_errors(exc: ValidationError) -> str:
    """One line per error, naming the field as `principles[i].field`."""
    lines = []
    for err in exc.errors():
        index, *rest = err["loc"]
        where = f"principles[{index}]" + "".join(f".{part}" for part in rest)
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def _messages(prompt: Prompt) -> list[Message]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def critique_prompt(principle: Principle, prompt: Prompt, answer: str) -> list[Message]:
    """The conversation that asks for a critique of `answer` under `principle`."""
    request = fill_template(principle.critique, {"prompt": prompt_text(prompt), "answer": answer})
    return [
        *_messages(prompt),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": request},
    ]


def revision_prompt(
    principle: Principle, prompt: Prompt, answer: str, asked: list[Message], critique: str
) -> list[Message]:
    """The critique conversation `asked`, continued with the critique and the revision request."""
    values = {"prompt": prompt_text(prompt), "answer": answer, "critique": critique}
    request = fill_template(principle.revision, values)
    return [*asked, {"role": "assistant", "content": critique}, {"role": "user", "content": request}]


async def critique_revise(
    generator: TextGenerator,
    prompts: Sequence[Prompt],
    answers: Sequence[str],
    principles: Sequence[Principle],
    *,
    max_tokens: int = 256,
    temperature: float = 0.7,
    seed: int | None = None,
) -> list[CaiChain]:
    """One chain per (prompt, answer): each principle in turn critiques and revises the current answer."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    ask = _Asker(generator, max_tokens, temperature, seed, len(prompts))
    current = list(answers)
    steps: list[list[CritiqueStep]] = [[] for _ in prompts]
    for principle in principles:
        asked = [critique_prompt(principle, p, a) for p, a in zip(prompts, current, strict=True)]
        critiques = await ask(asked)
        revise = [
            revision_prompt(principle, p, a, q, c)
            for p, a, q, c in zip(prompts, current, asked, critiques, strict=True)
        ]
        current = await ask(revise)
        for row, chain in enumerate(steps):
            chain.append(CritiqueStep(principle.name, asked[row], critiques[row], revise[row], current[row]))
    return [CaiChain(p, a, tuple(s)) for p, a, s in zip(prompts, answers, steps, strict=True)]


class _Asker:
    """One completion per prompt, a fresh seed range per call (when seeded), so no two steps share seeds."""

    def __init__(
        self, generator: TextGenerator, max_tokens: int, temperature: float, seed: int | None, rows: int
    ) -> None:
        self.generator, self.max_tokens, self.temperature = generator, max_tokens, temperature
        self.seed, self.rows, self.calls = seed, rows, 0

    async def __call__(self, prompts: list[list[Message]]) -> list[str]:
        seed = None if self.seed is None else self.seed + self.calls * self.rows
        self.calls += 1
        texts = await self.generator.generate(
            prompts, n=1, max_tokens=self.max_tokens, temperature=self.temperature, seed=seed
        )
        return [t[0] for t in texts]
