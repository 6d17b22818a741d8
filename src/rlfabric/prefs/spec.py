"""The pipeline file of `rlfabric prefs build`: where candidate pairs come from, who labels them, what
hygiene removes, and where the version is stored. TOML, YAML or JSON; unknown keys are errors.

    name = "helpful-v1"
    store = "prefs"

    [source]                       # kind "file": pairs or ratings; kind "sample": a generator's completions
    kind = "file"
    path = "data/pairs.jsonl"

    [[judges]]                     # kind "scorer": a reward scorer; kind "llm": an LLM pairwise judge
    kind = "scorer"
    scorer = "regex"
    params = {pattern = "\\\\boxed"}

    [hygiene.near_dup]
    threshold = 0.7

    [[hygiene.decontaminate]]
    name = "my-eval"
    path = "data/eval.jsonl"
    fields = ["prompt"]

Paths are read relative to the working directory, as a run file's are. The model-backed parts
(`generator` of a sampling source and of `[cai]`, an `llm` judge) are checked by their own models
(`prefs.generator_specs.GeneratorSpec`; `prefs.llm_judge.LlmJudgeSpec`, imported when an llm judge is
named: a pipeline of files and scorers loads no grpc or model code). Light by design: pydantic only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from rlfabric.prefs.generator_specs import GeneratorSpec
from rlfabric.prefs.store import DEFAULT_STORE
from rlfabric.runspec import MAX_BATCH, MAX_KEEP, MAX_SEED, MAX_TOKENS, RewardSpec
from rlfabric.runtime.config import StrictModel, read_file, validate

RowText = Literal["prompt", "chosen", "rejected"]
"""A row's texts, as decontamination names them."""
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Pipeline and judge names: a letter or digit, then up to 63 letters, digits, `_`, `.` or `-`."""


def generator_spec(value: Any) -> Any:
    """A `generator` table validated as `prefs.generator_specs.GeneratorSpec`."""
    if value is None:
        return None
    try:
        return TypeAdapter(GeneratorSpec).validate_python(value)
    except ValidationError as exc:
        raise ValueError(nested_errors(exc)) from None


def nested_errors(exc: ValidationError) -> str:
    """A nested model's validation errors as one message naming each field (pydantic reports a
    validator's ValueError at the outer field)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors())


# -- sources --------------------------------------------------------------------------------------------


class FileSource(StrictModel):
    """Pairs read from a dataset (through `rlfabric.data`, as a run reads its dataset: a JSONL, JSON,
    Parquet or CSV file, a folder, a `save_to_disk` folder, a hub id, or a prefs version folder). Format
    "pairs": each row is a labelled pair (prompt, chosen, rejected); "ratings": each row is one scored
    completion (prompt, completion, score), and pairs are formed per prompt by score, the higher chosen."""

    kind: Literal["file"]
    """A file of pairs or ratings."""
    path: str
    """Local file or folder, or a hub dataset id (`org/name`). A prefs version folder is verified
    first and becomes a parent of the new version."""
    split: str = "train"
    """Split read, e.g. "train" or "train[:1000]"."""
    name: str | None = None
    """Configuration of a hub dataset."""
    revision: str | None = None
    """Hub revision of `path`."""
    format: Literal["pairs", "ratings"] = "pairs"
    """"pairs": rows hold prompt, chosen and rejected; "ratings": rows hold prompt, completion and score."""
    prompt_field: str = "prompt"
    """Column with the prompt: a string or a list of {role, content} messages."""
    chosen_field: str = "chosen"
    """Format "pairs": column with the preferred completion."""
    rejected_field: str = "rejected"
    """Format "pairs": column with the dispreferred completion."""
    completion_field: str = "completion"
    """Format "ratings": column with the completion."""
    score_field: str = "score"
    """Format "ratings": column with the completion's score (a number; higher is better)."""
    reference_field: str | None = None
    """Column with a reference answer, shown to judges that use one (kept in each row's meta)."""
    pairing: Literal["best_worst", "all"] = "best_worst"
    """Format "ratings": "best_worst" pairs each prompt's highest-scored completion with its lowest;
    "all" pairs every two completions of a prompt whose scores differ by more than `min_score_gap`."""
    min_score_gap: float = Field(default=0.0, ge=0.0)
    """Format "ratings": two completions whose scores differ by this much or less form no pair (counted
    as `score_ties`)."""
    limit: int | None = Field(default=None, ge=1, le=10 * MAX_BATCH * MAX_KEEP)
    """Read at most this many rows (the first ones); None: all."""


class SampleSource(StrictModel):
    """Pairs formed from `k` completions per prompt sampled from a generator (a rollout replica or an
    OpenAI-compatible endpoint), labelled by the judges (at least one is required)."""

    kind: Literal["sample"]
    """Completions sampled from a generator."""
    prompts: str
    """File, folder or hub id of the prompts (read through `rlfabric.data`)."""
    split: str = "train"
    """Split of the prompts."""
    name: str | None = None
    """Configuration of a hub dataset."""
    revision: str | None = None
    """Hub revision of `prompts`."""
    prompt_field: str = "prompt"
    """Column with the prompt: a string or a list of {role, content} messages."""
    reference_field: str | None = None
    """Column with a reference answer, shown to judges that use one."""
    generator: Any
    """The generator (`prefs.generation.GeneratorSpec`): kind "rollout" (a replica's gRPC address and
    token) or "openai" (an OpenAI-compatible endpoint); see docs/prefs.md."""
    k: int = Field(default=2, ge=2, le=MAX_KEEP)
    """Completions sampled per prompt."""
    pairing: Literal["all", "consecutive"] = "all"
    """"all": every two of a prompt's k completions form a pair (k(k-1)/2); "consecutive": completions
    (0, 1), (2, 3), ... (k/2 disjoint pairs)."""
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS)
    """Longest completion, in tokens."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (above 0, or the k completions are equal)."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Sampling seed, where the generator supports one."""
    batch_size: int = Field(default=32, ge=1, le=MAX_BATCH)
    """Prompts per generation request (the progress bar advances per batch)."""
    limit: int | None = Field(default=None, ge=1, le=10 * MAX_BATCH * MAX_KEEP)
    """Use at most this many prompts (the first ones); None: all."""

    @field_validator("generator", mode="before")
    @classmethod
    def _generator(cls, value: Any) -> Any:
        return generator_spec(value)


Source = Annotated[FileSource | SampleSource, Field(discriminator="kind")]


# -- judges ---------------------------------------------------------------------------------------------


class ScorerJudgeSpec(RewardSpec):
    """A registered reward scorer as a pairwise judge (any of `rlfabric reward list`, programmatic or a
    `reward_model`; "composite" with `parts`): both completions are scored, the higher preferred, a
    difference within `tie_margin` a tie. `python_function` loads user code from the pipeline file's
    folder and the modules `params.function` names, as `rlfabric up` allows a run's reward."""

    kind: Literal["scorer"]
    """A reward scorer."""
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    """How reports and the manifest name this judge; default: the scorer's name (numbered if repeated)."""
    tie_margin: float = Field(default=0.0, ge=0.0)
    """Score differences up to this are ties."""


class LlmJudgeEntry(StrictModel):
    """An LLM pairwise judge (`prefs.llm_judge.LlmJudgeSpec`): every key but `kind` and `name` is that
    spec's (its `generator` and prompt template; see docs/prefs.md)."""

    model_config = ConfigDict(extra="allow")

    kind: Literal["llm"]
    """An LLM asked which answer is better."""
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    """How reports and the manifest name this judge; default "llm" (numbered if repeated)."""
    _spec: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _validate_llm_spec(self) -> LlmJudgeEntry:
        from rlfabric.prefs.llm_judge import LlmJudgeSpec  # its generators import grpc and httpx

        values = dict(self.model_extra or {})
        if self.name is not None:
            values["name"] = self.name
        try:
            self._spec = LlmJudgeSpec.model_validate(values)
        except ValidationError as exc:
            raise ValueError(nested_errors(exc)) from None
        return self

    @property
    def spec(self) -> Any:
        """The validated `LlmJudgeSpec`."""
        return self._spec


JudgeSpec = Annotated[ScorerJudgeSpec | LlmJudgeEntry, Field(discriminator="kind")]


class EnsembleSpec(StrictModel):
    """How the judges' votes on one pair become its label. A judge votes for a completion only when it
    prefers it in both orders; ties, disagreements between the two orders and errors are abstentions."""

    rule: Literal["majority", "unanimous"] = "majority"
    """"majority": the completion with more votes wins (equal votes: the pair is dropped as `split`);
    "unanimous": every judge must vote for it."""
    min_agreement: float = Field(default=0.5, ge=0.0, le=1.0)
    """Majority: the winner's votes over the number of judges must reach this (abstentions count
    against it), else the pair is dropped as `low_agreement`."""
    on_source_label: Literal["relabel", "filter"] = "relabel"
    """For pairs that come labelled (a pairs or ratings file, CAI): "relabel" takes the judges' label;
    "filter" keeps a pair only when the judges agree with its label (else dropped as `label_flip`)."""


# -- constitutional AI ----------------------------------------------------------------------------------


class CaiSpec(StrictModel):
    """Critique-revise (Constitutional AI): one answer per prompt of the source is critiqued and revised
    under each principle in turn; (prompt, revised, original) is added as a pair, revised chosen. The
    answer is a sampling source's first completion, a pairs file's rejected one, a ratings file's
    lowest-scored one."""

    principles: str
    """TOML/YAML file of principles (`prefs.cai.load_principles`)."""
    generator: Any
    """The generator that critiques and revises (`prefs.generation.GeneratorSpec`)."""
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS)
    """Longest critique or revision, in tokens."""
    temperature: float = Field(default=0.7, ge=0.0)
    """Sampling temperature of critiques and revisions."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Sampling seed, where the generator supports one."""
    judge: bool = False
    """Also ask the judges about CAI pairs (their label then follows `ensemble.on_source_label`);
    false: revised is chosen as is."""

    @field_validator("generator", mode="before")
    @classmethod
    def _generator(cls, value: Any) -> Any:
        return generator_spec(value)


# -- hygiene --------------------------------------------------------------------------------------------


class NormalizeSpec(StrictModel):
    """How texts are normalised before they are compared (every hygiene rule compares normalised texts)."""

    lowercase: bool = True
    """Compare case-insensitively (Unicode case folding)."""
    strip_punctuation: bool = False
    """Exact comparison ignores punctuation too (n-grams and shingles are made of words anyway)."""


class NearDupSpec(StrictModel):
    """Near-duplicate rows, found with MinHash + LSH (`datasketch`) over word shingles and confirmed by
    the shingle sets' exact Jaccard similarity. Within a prompt: two pairs of the same prompt whose
    completions (chosen with chosen, rejected with rejected) are near-duplicates. Across prompts: two
    rows of different prompts whose prompt and completions together are. The later row is dropped."""

    enabled: bool = True
    """Look for near-duplicates."""
    threshold: float = Field(default=0.7, gt=0.0, le=1.0)
    """Jaccard similarity of the shingle sets at or above which two texts are near-duplicates (with word
    pairs, one word changed in a 20-word text leaves 0.82, three in a 50-word text 0.78)."""
    num_perm: int = Field(default=128, ge=16, le=1024)
    """MinHash permutations (more: a sharper LSH estimate, slower)."""
    shingle_size: int = Field(default=2, ge=1, le=32)
    """Words per shingle (preference texts are short: pairs of words)."""
    scope: Literal["both", "within_prompt", "across_prompts"] = "both"
    """Which near-duplicates are dropped."""
    seed: int = Field(default=1, ge=0, le=MAX_SEED)
    """MinHash seed."""


class DecontaminateSpec(StrictModel):
    """A named evaluation set that no row may overlap: a row is dropped when the share of its text's word
    n-grams found in the set (`row_overlap`), or the share of the closest evaluation item's n-grams found
    in the row's text (`eval_overlap`: an evaluation question inside a longer prompt), reaches
    `threshold`. A text shorter than `ngram` words is one n-gram (it matches an equally short item)."""

    name: str = Field(pattern=NAME_PATTERN)
    """The evaluation set's name (in the report and every drop record)."""
    path: str
    """File, folder or hub id of the evaluation set (read through `rlfabric.data`)."""
    split: str = "train"
    """Split of the evaluation set, e.g. "test"."""
    config_name: str | None = None
    """Configuration of a hub dataset (`datasets.load_dataset`'s `name`)."""
    revision: str | None = None
    """Hub revision of `path`."""
    fields: list[str] = Field(default_factory=lambda: ["prompt"], min_length=1)
    """Columns of the evaluation set whose text is compared (joined): strings or chat messages."""
    ngram: int = Field(default=8, ge=1, le=64)
    """Words per n-gram."""
    threshold: float = Field(default=0.5, gt=0.0, le=1.0)
    """Overlap at or above which a row is contaminated."""
    check: list[RowText] = Field(default_factory=lambda: list[RowText](["prompt"]))
    """Which of the row's texts are compared (each on its own; the worst counts)."""


class HygieneSpec(StrictModel):
    """Rows removed before judging, each recorded with its reason in the version's `dropped.jsonl`:
    exact duplicates (same prompt and completions after normalisation; the same pair with the opposite
    label is a `conflict`, both dropped), pairs whose two completions are equal, near-duplicates, and rows
    overlapping an evaluation set."""

    exact_dedup: bool = True
    """Drop exact duplicates (and conflicting labels of one pair)."""
    drop_identical: bool = True
    """Drop pairs whose chosen and rejected completions are equal after normalisation."""
    normalize: NormalizeSpec = Field(default_factory=NormalizeSpec)
    """Text normalisation."""
    near_dup: NearDupSpec = Field(default_factory=NearDupSpec)
    """Near-duplicates (MinHash/LSH)."""
    decontaminate: list[DecontaminateSpec] = Field(default_factory=list)
    """Evaluation sets no row may overlap."""

    @model_validator(mode="after")
    def _unique_eval_names(self) -> HygieneSpec:
        names = [d.name for d in self.decontaminate]
        if len(names) != len(set(names)):
            raise ValueError("decontaminate: evaluation set names must be unique")
        return self


# -- the pipeline ---------------------------------------------------------------------------------------


class PipelineSpec(StrictModel):
    """A preference-data pipeline: source, CAI, hygiene, judges, and the store its version goes to."""

    name: str = Field(pattern=NAME_PATTERN)
    """The dataset's name (versions of one name are listed together)."""
    store: str = DEFAULT_STORE
    """Folder holding the dataset versions (`rlfabric prefs build --store` overrides it)."""
    source: Source
    """Where candidate pairs come from."""
    judges: list[JudgeSpec] = Field(default_factory=list)
    """Who labels the pairs (each asked in both orders); none: the source's labels are kept."""
    ensemble: EnsembleSpec = Field(default_factory=EnsembleSpec)
    """How several judges' votes combine."""
    cai: CaiSpec | None = None
    """Critique-revise pairs added to the source's."""
    hygiene: HygieneSpec = Field(default_factory=HygieneSpec)
    """Deduplication and decontamination."""
    parents: list[str] = Field(default_factory=list)
    """Versions this build derives from (ids, unique id prefixes or version folders), recorded as its
    lineage; a source that is a version folder is added by itself."""
    shard_rows: int = Field(default=50_000, ge=1, le=10 * MAX_BATCH)
    """Rows per data shard."""
    judge_batch_size: int = Field(default=64, ge=1, le=MAX_BATCH)
    """Comparisons sent to a judge per call (the progress bar advances per call)."""

    @model_validator(mode="after")
    def _sampling_needs_judges(self) -> PipelineSpec:
        if isinstance(self.source, SampleSource) and not self.judges:
            raise ValueError("judges: a sampling source needs at least one judge to label its pairs")
        if self.cai is not None and self.cai.judge and not self.judges:
            raise ValueError("cai.judge: no judges are declared")
        return self

    def judge_names(self) -> list[str]:
        """Each judge's name: its own, else its scorer's name (or "llm"), numbered when repeated."""
        base = [j.name or (j.scorer if isinstance(j, ScorerJudgeSpec) else "llm") for j in self.judges]
        names = []
        for i, name in enumerate(base):
            explicit = self.judges[i].name is not None
            names.append(name if explicit or base.count(name) == 1 else f"{name}-{base[:i].count(name) + 1}")
        return names

    @model_validator(mode="after")
    def _unique_judge_names(self) -> PipelineSpec:
        names = self.judge_names()
        if len(names) != len(set(names)):
            raise ValueError(f"judges: names must be unique (got {names})")
        return self


def load_pipeline(path: str | Path) -> tuple[PipelineSpec, str]:
    """The pipeline file's spec and its text (the manifest keeps the text); `ConfigError` naming the file
    and every bad field."""
    spec = validate(PipelineSpec, read_file(path), str(path))
    return spec, Path(path).read_text(encoding="utf-8")
