"""The operator's limits on a preference pipeline submitted to the coordinator (`POST /v1/prefs/builds`).

A pipeline comes from whoever holds the API token and runs on the coordinator's machine, so it gets the
limits a run gets, each refusal naming the field (422) and never saying whether a file exists:

1. every path it names lies in the roots (`runtime.paths`): the source's file or prompts, the
   decontamination sets and parents as data; the principles file as data, a local file only; the model a
   `kind = "local"` generator serves and a `reward_model` judge's models as models (a judge's model is
   local only);
2. its version goes to the coordinator's store (`prefs.store`), never where the request says;
3. a scorer judge's user code (`python_function`'s `function`) is allowed by `prefs.allowed_functions`,
   checked as a string (nothing is imported here);
4. an environment variable named as a credential (`token_env`, `api_key_env`) is listed in
   `prefs.credential_envs` with the endpoint it is sent to;
5. a `kind = "local"` generator (it starts processes) only where `prefs.allow_local_generators`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.coordinator.config import PrefsBuildsConfig
from rlfabric.prefs.generator_specs import LocalGeneratorSpec, OpenAIGeneratorSpec, RolloutGeneratorSpec
from rlfabric.prefs.spec import NAME_PATTERN, FileSource, LlmJudgeEntry, PipelineSpec, ScorerJudgeSpec
from rlfabric.prefs.store import DEFAULT_STORE
from rlfabric.runtime.paths import PathViolation, Roots, allowed, within
from rlfabric.runtime.user_code import FunctionAllowlist, InvalidReference, check_attribute_path

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class LimitIssue:
    """One thing the operator does not allow: where (`loc`, the field's path in the body), why, and the
    kind (`path_not_allowed`, `store_not_allowed`, `function_not_allowed`, `credential_not_allowed`,
    `local_generator_not_enabled`)."""

    loc: Loc
    message: str
    kind: str


def pipeline_issues(spec: PipelineSpec, limits: PrefsBuildsConfig, roots: Roots) -> list[LimitIssue]:
    """Everything in `spec` the operator's limits refuse, in field order."""
    return [
        *path_issues(spec, roots),
        *store_issues(spec, limits),
        *function_issues(spec, limits),
        *generator_issues(spec, limits),
    ]


# -- 1. paths -------------------------------------------------------------------------------------------


def path_issues(spec: PipelineSpec, roots: Roots) -> list[LimitIssue]:
    return [
        LimitIssue(loc, PathViolation(".".join(map(str, loc)), kind).message, "path_not_allowed")
        for loc, kind, path, hub in named_paths(spec)
        if not (allowed(path, kind, roots) if hub else within(path, roots.for_kind(kind)))
    ]


def named_paths(spec: PipelineSpec) -> Iterator[tuple[Loc, Any, str, bool]]:
    """(field, kind, path, whether a hub id is allowed there) of every path the pipeline names."""
    if isinstance(spec.source, FileSource):
        yield ("source", "path"), "data", spec.source.path, True
    else:
        yield ("source", "prompts"), "data", spec.source.prompts, True
    if spec.cai is not None:
        yield ("cai", "principles"), "data", spec.cai.principles, False
    for i, d in enumerate(spec.hygiene.decontaminate):
        yield ("hygiene", "decontaminate", i, "path"), "data", d.path, True
    for i, ref in enumerate(spec.parents):
        if not is_plain_name(ref):  # an id or a pipeline name is looked up in the store
            yield ("parents", i), "data", ref, False
    for loc, generator in generators(spec):
        if isinstance(generator, LocalGeneratorSpec):
            yield (*loc, "model"), "model", generator.model, True
    for loc, params in scorer_params(spec):
        for key in ("path", "paths"):
            value = params.get(key)
            for j, path in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(path, str):
                    yield (*loc, key, *([j] if isinstance(value, list) else [])), "model", path, False


def is_plain_name(ref: str) -> bool:
    """True for a version id, id prefix or pipeline name (no folder path)."""
    return re.fullmatch(NAME_PATTERN, ref) is not None and ref not in (".", "..")


# -- 2. the store ---------------------------------------------------------------------------------------


def store_issues(spec: PipelineSpec, limits: PrefsBuildsConfig) -> list[LimitIssue]:
    if spec.store == DEFAULT_STORE or _same_folder(spec.store, limits.store):
        return []
    message = "builds through the coordinator write to its own store (prefs.store); leave `store` unset"
    return [LimitIssue(("store",), message, "store_not_allowed")]


def _same_folder(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError, RuntimeError):
        return False


# -- 3. user code ---------------------------------------------------------------------------------------


def scorer_params(spec: PipelineSpec) -> Iterator[tuple[Loc, dict[str, Any]]]:
    """(field of the params, params) of every scorer judge and each of its composite parts."""
    for i, judge in enumerate(spec.judges):
        if isinstance(judge, ScorerJudgeSpec):
            yield ("judges", i, "params"), judge.params
            for j, part in enumerate(judge.parts):
                yield ("judges", i, "parts", j, "params"), part.params


def function_issues(spec: PipelineSpec, limits: PrefsBuildsConfig) -> list[LimitIssue]:
    allowlist = FunctionAllowlist.parse(limits.allowed_functions)
    issues = []
    for loc, params in scorer_params(spec):
        named = params.get("function")
        refs = named if isinstance(named, list) else [named]
        for j, ref in enumerate(refs):
            if not isinstance(ref, str):
                continue
            reason = function_refusal(ref, allowlist)
            if reason is not None:
                where = (*loc, "function", *([j] if isinstance(named, list) else []))
                message = f"{reason} (prefs.allowed_functions)"
                issues.append(LimitIssue(where, message, "function_not_allowed"))
    return issues


def function_refusal(reference: str, allowlist: FunctionAllowlist) -> str | None:
    """Why `reference` may not load under `allowlist`, else None; decided on the string alone (a file
    reference by its resolved path, without looking at the file)."""
    target, _, attr = reference.rpartition(":")
    try:
        check_attribute_path(attr)
        if not target:
            raise InvalidReference(f"expected 'module:attr' or 'path.py:attr', got {reference!r}")
        if target.endswith(".py"):
            if not any(within(target, [d]) for d in allowlist.directories):
                raise InvalidReference(f"{reference!r} is not in an allowed directory")
        else:
            allowlist.check_module(target, attr)
    except InvalidReference as exc:
        return exc.reason
    return None


# -- 4, 5. generators and credentials -------------------------------------------------------------------


def generators(spec: PipelineSpec) -> Iterator[tuple[Loc, Any]]:
    """(field, spec) of every generator: the sampling source's, `[cai]`'s and each llm judge's."""
    source_generator = getattr(spec.source, "generator", None)
    if source_generator is not None:
        yield ("source", "generator"), source_generator
    if spec.cai is not None:
        yield ("cai", "generator"), spec.cai.generator
    for i, judge in enumerate(spec.judges):
        if isinstance(judge, LlmJudgeEntry):
            yield ("judges", i, "generator"), judge.spec.generator


def generator_issues(spec: PipelineSpec, limits: PrefsBuildsConfig) -> list[LimitIssue]:
    issues = []
    for loc, generator in generators(spec):
        if isinstance(generator, LocalGeneratorSpec) and not limits.allow_local_generators:
            message = "local generators (they start processes) are not enabled (prefs.allow_local_generators)"
            issues.append(LimitIssue((*loc, "kind"), message, "local_generator_not_enabled"))
        elif isinstance(generator, RolloutGeneratorSpec) and generator.token_env is not None:
            issues += credential_issues((*loc, "token_env"), generator.token_env, generator.address, limits)
        elif isinstance(generator, OpenAIGeneratorSpec) and generator.api_key_env is not None:
            key_env, url = generator.api_key_env, generator.base_url
            issues += credential_issues((*loc, "api_key_env"), key_env, url, limits)
    for loc, params in scorer_params(spec):
        named = params.get("api_key_env")
        if isinstance(named, str):
            endpoint = str(params.get("base_url") or "")
            issues += credential_issues((*loc, "api_key_env"), named, endpoint, limits)
    return issues


def credential_issues(loc: Loc, env: str, endpoint: str, limits: PrefsBuildsConfig) -> list[LimitIssue]:
    """A refusal unless `prefs.credential_envs` lets the variable `env` go to `endpoint`."""
    home = limits.credential_envs.get(env)
    if home is None:
        message = f"{env!r} is not in the coordinator's prefs.credential_envs"
    elif sends_to(endpoint, home):
        return []
    else:
        message = f"the value of {env!r} may only be sent to {home!r} (prefs.credential_envs)"
    return [LimitIssue(loc, message, "credential_not_allowed")]


def sends_to(endpoint: str, home: str) -> bool:
    """True when `endpoint` is `home`, or (URLs) lies below it."""
    endpoint, home = endpoint.rstrip("/"), home.rstrip("/")
    return endpoint == home or ("://" in home and endpoint.startswith(home + "/"))
