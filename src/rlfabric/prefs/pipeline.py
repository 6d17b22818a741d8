"""`rlfabric prefs build`: a pipeline file run stage by stage into a dataset version.

    1. lineage   resolve `parents` in the store (a source that is a version folder is verified by
                 `rlfabric.data` as it is read, and becomes a parent); hash the input files
    2. source    candidate pairs: a pairs or ratings file, or k sampled completions per prompt
    3. cai       critique-revise pairs (revised over original) added, when `[cai]` is declared
    4. hygiene   identical, exact and near-duplicate, contaminated candidates dropped (`prefs.hygiene`)
    5. judging   every judge on every remaining candidate in both orders, votes combined
                 (`prefs.judging`); without judges the source's labels stand
    6. rows      each kept candidate as a `PrefPair`, its provenance and votes in `meta`
    7. report    counts per stage, hygiene, judges, balance (`prefs.report`)
    8. store     the version written atomically under its content id (`prefs.store`)

Every dropped candidate goes to the version's `dropped.jsonl` with its stage, rule and evidence. Stages
whose generators are specified alike (the source's, `[cai]`'s, an llm judge's) share one instance
(`SharedGenerators`): a `kind = "local"` replica starts once per build, not once per stage.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlfabric import __version__
from rlfabric.data import DatasetError
from rlfabric.prefs import store
from rlfabric.prefs.hygiene import EvalSet, HygieneResult, run_hygiene
from rlfabric.prefs.judging import Judged, JudgingResult, close_judges, judge_candidates, make_judges
from rlfabric.prefs.report import build_report, markdown
from rlfabric.prefs.sources import Candidate, Side, SourceResult, read_file_source, sample_source
from rlfabric.prefs.spec import CaiSpec, FileSource, PipelineSpec
from rlfabric.prefs.types import CaiChain, PrefPair
from rlfabric.runtime.paths import is_hub_id


class PipelineError(ValueError):
    """The pipeline cannot run as declared (a parent not found, ...); the message names the field."""


@dataclass(frozen=True)
class BuildResult:
    """A finished build: the version (and whether it was already in the store) and its report."""

    id: str
    path: Path
    existed: bool
    report: dict[str, Any]


class Progress:
    """Progress bars on stderr (tqdm) for the long stages, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    @contextmanager
    def bar(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        if not self.enabled or total == 0:
            yield lambda _: None
            return
        from tqdm import tqdm

        with tqdm(total=total, desc=label, leave=False, file=sys.stderr) as bar:
            yield bar.update

    def note(self, text: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(f"prefs: {text}", file=sys.stderr)


async def build(
    spec: PipelineSpec,
    pipeline_text: str,
    pipeline_file: str | None = None,
    store_dir: str | Path | None = None,
    progress: bool = False,
    policy: Any | None = None,
) -> BuildResult:
    """Run every stage of the module docstring; the written (or found) version. `policy` (a
    `reward.scorers.policy.ScorerPolicy`) is the scorer judges' instead of the default (user code from
    the pipeline file's folder and the modules the judges name)."""
    started = time.monotonic()
    show = Progress(progress)
    root = Path(store_dir if store_dir is not None else spec.store)
    parents = resolve_parents(spec, root)
    async with SharedGenerators() as generators:
        source = await run_source(spec, show, generators)
        cai, cai_generator = await run_cai(spec.cai, source, show, generators) if spec.cai else ([], None)
        candidates = number([*source.candidates, *cai])
        hygiene = run_clean(spec, candidates, show)
        judging, rows = await run_judging(spec, hygiene.kept, pipeline_file, show, policy, generators)
    stages = stage_counts(source, cai, candidates, hygiene, judging, rows)
    judging_report = None
    if judging is not None:
        dropped = dict(sorted(Counter(d.rule for d in judging.dropped).items()))
        judging_report = {"judges": judging.judges, "agreement": judging.agreement, "dropped": dropped}
    report = build_report(stages, hygiene.counts, judging_report, rows)
    used = {"source": source.generator, "cai": cai_generator}
    fields = manifest_fields(spec, pipeline_text, parents, used, judging, stages)
    build_notes = {"rlfabric": __version__, "pipeline_file": pipeline_file, "seconds": 0.0}
    build_notes["seconds"] = round(time.monotonic() - started, 3)
    dropped_rows = [d.as_record() for d in hygiene.dropped + (judging.dropped if judging else [])]
    show.note(f"writing {len(rows)} rows")
    written = store.write_version(
        root,
        rows,
        fields=fields,
        dropped=dropped_rows,
        report=report,
        report_md=markdown(report, f"{spec.name}: preference dataset version"),
        shard_rows=spec.shard_rows,
        build=build_notes,
    )
    return BuildResult(written.id, written.path, written.existed, report)


# -- stages ---------------------------------------------------------------------------------------------


class SharedGenerators:
    """One generator per distinct generator spec for the whole build (the spec's JSON is the key), closed
    when the build leaves the context: stages that name the same generator share its instance."""

    def __init__(self) -> None:
        self._by_spec: dict[str, Any] = {}

    def get(self, spec: Any) -> Any:
        """The build's generator for `spec` (a `GeneratorSpec`), made on first request."""
        from rlfabric.prefs.generation import make_generator

        key = spec.model_dump_json()
        if key not in self._by_spec:
            self._by_spec[key] = make_generator(spec)
        return self._by_spec[key]

    async def __aenter__(self) -> SharedGenerators:
        return self

    async def __aexit__(self, *_: object) -> None:
        for generator in self._by_spec.values():
            await generator.close()
        self._by_spec.clear()


def resolve_parents(spec: PipelineSpec, root: Path) -> list[str]:
    """The full ids of `parents` (looked up in the store) and of a source that is a version folder."""
    ids = []
    for i, ref in enumerate(spec.parents):
        try:
            folder = store.resolve(root, ref)
        except store.StoreError as exc:
            raise PipelineError(f"parents[{i}]: {exc}") from None
        ids.append(store.read_manifest(folder)["id"])
    if isinstance(spec.source, FileSource):
        own = store.version_of(spec.source.path)
        if own is not None and own not in ids:
            ids.append(own)
    return ids


async def run_source(spec: PipelineSpec, show: Progress, generators: SharedGenerators) -> SourceResult:
    if isinstance(spec.source, FileSource):
        show.note(f"reading {spec.source.path}")
        return read_file_source(spec.source)
    total = spec.source.limit or 0
    with show.bar("sampling", total) as advance:
        return await sample_source(spec.source, advance, generators.get(spec.source.generator))


async def run_cai(
    spec: CaiSpec, source: SourceResult, show: Progress, generators: SharedGenerators
) -> tuple[list[Candidate], dict[str, Any]]:
    """Critique-revise each prompt's answer (`SourceResult.cai_answers`): (revised, original) pairs, and
    the generator's description."""
    from rlfabric.prefs.cai import critique_revise, load_principles

    principles = load_principles(spec.principles)
    generator = generators.get(spec.generator)
    answers = source.cai_answers
    show.note(f"critique-revise: {len(answers)} answers x {len(principles)} principles")
    chains = await critique_revise(
        generator,
        [p for p, _, _ in answers],
        [a for _, a, _ in answers],
        principles,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        seed=spec.seed,
    )
    described = generator.describe()
    pairs = [cai_candidate(chain, origin) for chain, (_, _, origin) in zip(chains, answers, strict=True)]
    return pairs, described


def cai_candidate(chain: CaiChain, origin: dict[str, Any]) -> Candidate:
    meta = {"source": "cai", "of": origin, "cai": {**asdict(chain), "revised": chain.revised}}
    return Candidate(chain.prompt, chain.revised, chain.original, "first", "", meta)


def number(candidates: list[Candidate]) -> list[Candidate]:
    for index, candidate in enumerate(candidates):
        candidate.index = index
    return candidates


def run_clean(spec: PipelineSpec, candidates: Sequence[Candidate], show: Progress) -> HygieneResult:
    eval_sets = [EvalSet.read(d, i) for i, d in enumerate(spec.hygiene.decontaminate)]
    return run_hygiene(candidates, spec.hygiene, eval_sets, lambda step: show.note(f"hygiene: {step}"))


async def run_judging(
    spec: PipelineSpec,
    candidates: list[Candidate],
    pipeline_file: str | None,
    show: Progress,
    policy: Any | None = None,
    generators: SharedGenerators | None = None,
) -> tuple[JudgingResult | None, list[PrefPair]]:
    """The judges on the candidates that need them; every kept candidate as a row, in candidate order."""
    if not spec.judges:
        return None, [source_row(c) for c in candidates]
    skip_cai = spec.cai is not None and not spec.cai.judge
    asked = [c for c in candidates if not (skip_cai and c.meta.get("source") == "cai")]
    judges = make_judges(spec, pipeline_file, policy, generators.get if generators else None)
    try:
        with show.bar("judging", len(asked) * len(judges)) as advance:
            result = await judge_candidates(judges, asked, spec.ensemble, spec.judge_batch_size, advance)
    finally:
        await close_judges(judges)
    judged = {j.candidate.index: j for j in result.kept}
    asked_ids = {c.index for c in asked}
    rows = []
    for c in candidates:
        if c.index in judged:
            rows.append(judged_row(judged[c.index]))
        elif c.index not in asked_ids:
            rows.append(source_row(c))
    return result, rows


def source_row(c: Candidate) -> PrefPair:
    """A candidate labelled by its source."""
    assert c.label is not None
    return make_row(c, c.label, {"label_by": "source"})


def judged_row(j: Judged) -> PrefPair:
    """A candidate labelled by the judges, with every judge's vote."""
    votes = {v.judge: v.as_meta(j.winner) for v in j.outcome.votes}
    extra = {"label_by": "judges", "votes": votes, "agreement": round(j.outcome.agreement, 4)}
    return make_row(j.candidate, j.winner, extra)


def make_row(c: Candidate, winner: Side, extra: dict[str, Any]) -> PrefPair:
    """The row of a candidate whose `winner` side is chosen; `meta`: the source's provenance,
    `source_first` (which column the source's first completion became), `source_label` (whether a
    labelled source agreed: "chosen") and `extra`."""
    chosen, rejected = (c.first, c.second) if winner == "first" else (c.second, c.first)
    meta = {**c.meta, "source_first": "chosen" if winner == "first" else "rejected", **extra}
    if c.label is not None:
        meta["source_label"] = "chosen" if c.label == winner else "rejected"
    if c.reference:
        meta["reference"] = c.reference
    return PrefPair(c.prompt, chosen, rejected, meta)


# -- the manifest ---------------------------------------------------------------------------------------


def stage_counts(
    source: SourceResult,
    cai: Sequence[Candidate],
    candidates: Sequence[Candidate],
    hygiene: HygieneResult,
    judging: JudgingResult | None,
    rows: Sequence[PrefPair],
) -> dict[str, Any]:
    stages: dict[str, Any] = {"source": dict(source.counts)}
    stages["cai"] = {"added": len(cai)}
    stages["hygiene"] = {"in": len(candidates), "dropped": len(hygiene.dropped), "kept": len(hygiene.kept)}
    if judging is not None:
        asked = len(judging.kept) + len(judging.dropped)
        stages["judging"] = {"in": asked, "dropped": len(judging.dropped), "kept": len(judging.kept)}
    stages["rows"] = {"written": len(rows)}
    return stages


def manifest_fields(
    spec: PipelineSpec,
    text: str,
    parents: list[str],
    generators: dict[str, dict[str, Any] | None],
    judging: JudgingResult | None,
    stages: dict[str, Any],
) -> dict[str, Any]:
    """The manifest's lineage entries (`prefs.store`): what the version was built from and by whom."""
    return {
        "name": spec.name,
        "pipeline": {"text": text, "sha256": hashlib.sha256(text.encode()).hexdigest()},
        "parents": parents,
        "inputs": inputs(spec),
        "judges": {n: s["describe"] for n, s in judging.judges.items()} if judging else {},
        "generators": {k: v for k, v in generators.items() if v is not None},
        "counts": stages,
    }


def inputs(spec: PipelineSpec) -> list[dict[str, Any]]:
    """Each input the pipeline names, with its content hash (a version: its id; a hub id: its revision)."""
    named: list[tuple[str, str, str | None]] = []
    if isinstance(spec.source, FileSource):
        named.append(("source.path", spec.source.path, spec.source.revision))
    else:
        named.append(("source.prompts", spec.source.prompts, spec.source.revision))
    if spec.cai is not None:
        named.append(("cai.principles", spec.cai.principles, None))
    for i, d in enumerate(spec.hygiene.decontaminate):
        named.append((f"hygiene.decontaminate[{i}].path", d.path, d.revision))
    return [input_entry(field, path, revision) for field, path, revision in named]


def input_entry(field: str, path: str, revision: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"field": field, "path": path}
    local = Path(path)
    version = store.version_of(local)
    if version is not None:
        entry["version"] = version
    elif local.is_file():
        entry["sha256"] = store.sha256_file(local)
    elif local.is_dir():
        entry["sha256"] = tree_hash(local)
    elif is_hub_id(path):
        entry["revision"] = revision
    else:
        raise DatasetError(f"{field} {path}: no such file or folder (nor a hub id org/name)")
    return entry


def tree_hash(folder: Path) -> str:
    """sha256 over the relative paths and sha256s of every file under `folder`, in path order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder).as_posix()}\0{store.sha256_file(path)}\n".encode())
    return digest.hexdigest()
