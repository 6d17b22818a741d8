"""The store of preference dataset versions: immutable, content-addressed folders.

A version is a folder named by its id, inside the store folder:

    <id>/
      manifest.json          what the version is (below); written last
      data/shard-00000.jsonl the rows: {"prompt", "chosen", "rejected", "meta"}; `meta` is a JSON object
      data/shard-00001.jsonl   encoded as a string, so every shard reads with one schema (`datasets`,
      ...                      pandas); `shard_rows` rows a shard
      dropped.jsonl          every candidate a stage removed, with its rule and evidence
      report.json, report.md the build report (`prefs.report`)

`manifest.json` holds the format (`FORMAT`), the pipeline's name, file text and sha256, the parent
versions, the inputs' sha256, the judges' and generators' descriptions, each shard's path, sha256 and row
count, the other files' sha256, the counts and the report; then `created` (UTC) and `build` (the
rlfabric version, the pipeline file's path, seconds) and `id`.

The id is the sha256 of the manifest's canonical JSON (keys sorted, no spaces, UTF-8) without `id`,
`created` and `build`: the same pipeline on the same inputs, with judges that answer the same, gives the
same id, and a version found under its id again is left as it is (the build says so). A version is
written to a temporary folder in the store and renamed into place: a reader sees all of it or none of
it, and an existing folder is never overwritten (its files are also made read-only).
`verify(folder)` re-hashes every file against the manifest and the manifest against the id.

Light by design: the standard library only, so `rlfabric.data` verifies a version before a run reads it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.prefs.types import PrefPair

DEFAULT_STORE = "prefs"
"""The store folder when neither a pipeline file nor `--store` names one."""
FORMAT = "rlfabric.prefs/1"
"""The manifest's `format`: a reader refuses any other."""
MANIFEST = "manifest.json"
DATA = "data"
DROPPED = "dropped.jsonl"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
VOLATILE = ("id", "created", "build")
"""Manifest keys left out of the id: the id itself, and what differs between identical builds."""
MIN_PREFIX = 4
"""Shortest id prefix a command accepts."""
CHUNK = 1 << 20


class StoreError(ValueError):
    """A version cannot be found, read or written; the message names it."""


# -- hashing --------------------------------------------------------------------------------------------


def canonical(value: Any) -> bytes:
    """Canonical JSON: keys sorted, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def version_id(manifest: dict[str, Any]) -> str:
    """The id of a manifest: sha256 of its canonical JSON without the `VOLATILE` keys."""
    return hashlib.sha256(canonical({k: v for k, v in manifest.items() if k not in VOLATILE})).hexdigest()


def row_hash(prompt: Any, chosen: str, rejected: str) -> str:
    """A row's content hash (prompt, chosen, rejected; not meta): what `diff` compares."""
    return hashlib.sha256(canonical([prompt, chosen, rejected])).hexdigest()


def row_line(pair: PrefPair) -> str:
    meta = json.dumps(pair.meta, sort_keys=True, ensure_ascii=False)
    row = {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected, "meta": meta}
    return json.dumps(row, ensure_ascii=False) + "\n"


# -- writing --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    """A version in the store: its id and folder, and whether this build found it already there."""

    id: str
    path: Path
    existed: bool
    manifest: dict[str, Any]


def write_version(
    store: Path,
    pairs: Sequence[PrefPair],
    *,
    fields: dict[str, Any],
    dropped: Sequence[dict[str, Any]] = (),
    report: dict[str, Any],
    report_md: str = "",
    shard_rows: int = 50_000,
    build: dict[str, Any] | None = None,
) -> Written:
    """Write a version of `pairs` into `store` (module docstring). `fields` are the manifest's lineage
    entries (name, pipeline, parents, inputs, judges, generators, counts); `build` its volatile notes."""
    store.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=store))
    try:
        shards = write_shards(tmp / DATA, pairs, shard_rows)
        files = {
            DROPPED: write_file(
                tmp / DROPPED, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dropped)
            ),
            REPORT_JSON: write_file(
                tmp / REPORT_JSON, json.dumps(report, indent=2, ensure_ascii=False) + "\n"
            ),
            REPORT_MD: write_file(tmp / REPORT_MD, report_md),
        }
        manifest = {"format": FORMAT, **fields, "rows": len(pairs), "shards": shards, "files": files}
        manifest["report"] = report
        vid = version_id(manifest)
        manifest.update(id=vid, created=utc_now(), build=build or {})
        write_file(tmp / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        fsync_dir(tmp / DATA)
        tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the version from other users (a learner's)
        fsync_dir(tmp)
        return place(store, tmp, vid, manifest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_shards(folder: Path, pairs: Sequence[PrefPair], shard_rows: int) -> list[dict[str, Any]]:
    """Rows in shards of `shard_rows` (one empty shard for no rows): path, sha256, rows of each."""
    folder.mkdir()
    shards = []
    starts = range(0, len(pairs), shard_rows) if pairs else range(1)
    for number, start in enumerate(starts):
        chunk = pairs[start : start + shard_rows]
        rel = f"{DATA}/shard-{number:05d}.jsonl"
        digest = write_file(folder.parent / rel, "".join(row_line(p) for p in chunk))
        shards.append({"path": rel, "sha256": digest, "rows": len(chunk)})
    return shards


def write_file(path: Path, text: str) -> str:
    """Write `text` (UTF-8), flush it to disk, make it read-only; its sha256."""
    data = text.encode()
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    path.chmod(0o444)
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def place(store: Path, tmp: Path, vid: str, manifest: dict[str, Any]) -> Written:
    """Rename `tmp` to `store/vid`, unless that version is already there (then it is kept as it is)."""
    target = store / vid
    if not target.exists():
        try:
            tmp.rename(target)
        except OSError:  # another build placed the same version first
            if not target.exists():
                raise
        else:
            fsync_dir(store)
            return Written(vid, target, False, manifest)
    problems = verify(target).problems
    if problems:
        raise StoreError(f"{target}: a version with this id exists and does not verify: {problems[0]}")
    return Written(vid, target, True, read_manifest(target))


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- reading --------------------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict[str, Any]:
    """A version's manifest; `StoreError` if it is missing, not JSON or of another format."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{folder}: no {MANIFEST}: not a preference dataset version") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise StoreError(f"{folder}: {MANIFEST} is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{folder}: {MANIFEST} is not a {FORMAT} manifest")
    return manifest


def is_version(path: str | Path) -> bool:
    """Whether `path` is a folder holding a preference version's manifest (it may not verify)."""
    folder = Path(path)
    if not (folder / MANIFEST).is_file():
        return False
    try:
        read_manifest(folder)
    except StoreError:
        return False
    return True


def version_of(path: str | Path) -> str | None:
    """The id a version folder's manifest declares (None: `path` is not a version folder)."""
    if not is_version(path):
        return None
    return str(read_manifest(Path(path)).get("id"))


def shard_paths(folder: Path) -> list[Path]:
    """The data files of a version, in order (as the manifest lists them)."""
    return [folder / s["path"] for s in read_manifest(folder)["shards"]]


def iter_rows(folder: Path) -> Iterator[dict[str, Any]]:
    """Every row of a version, `meta` decoded."""
    for path in shard_paths(folder):
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                row["meta"] = json.loads(row["meta"])
                yield row


# -- verification ---------------------------------------------------------------------------------------


@dataclass
class Verification:
    """What `verify` found: no problems means the version is exactly what its manifest says."""

    folder: Path
    id: str | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(folder: str | Path) -> Verification:
    """Re-hash every file of a version against its manifest and the manifest against its id."""
    folder = Path(folder)
    result = Verification(folder)
    try:
        manifest = read_manifest(folder)
    except StoreError as exc:
        result.problems.append(str(exc).removeprefix(f"{folder}: "))
        return result
    result.id = manifest.get("id")
    if version_id(manifest) != result.id:
        result.problems.append(f"{MANIFEST} was changed: its content does not hash to its id")
    listed = {s["path"]: s for s in manifest.get("shards", [])}
    for rel, entry in listed.items():
        result.problems += file_problems(folder, rel, entry["sha256"], entry["rows"])
    for rel, digest in manifest.get("files", {}).items():
        result.problems += file_problems(folder, rel, digest, None)
    if sum(s["rows"] for s in listed.values()) != manifest.get("rows"):
        result.problems.append("the shards' row counts do not add up to the manifest's rows")
    data = folder / DATA
    extra = (
        sorted(p.name for p in data.iterdir() if f"{DATA}/{p.name}" not in listed) if data.is_dir() else []
    )
    result.problems += [f"{DATA}/{name}: a file the manifest does not list" for name in extra]
    if result.id and folder.name != result.id:
        result.notes.append(f"the folder is not named by the version's id ({result.id[:12]})")
    return result


def file_problems(folder: Path, rel: str, digest: str, rows: int | None) -> list[str]:
    path = folder / rel
    if not path.is_file():
        return [f"{rel}: missing"]
    if sha256_file(path) != digest:
        return [f"{rel}: sha256 differs from the manifest's (the file was changed)"]
    if rows is not None:
        with path.open("rb") as f:
            count = sum(1 for _ in f)
        if count != rows:
            return [f"{rel}: {count} rows, the manifest says {rows}"]
    return []


# -- the store ------------------------------------------------------------------------------------------


def versions(store: Path) -> list[Path]:
    """The version folders of a store, oldest first (by `created`, then id)."""
    if not store.is_dir():
        return []
    found = [p for p in store.iterdir() if p.is_dir() and not p.name.startswith(".") and is_version(p)]
    return sorted(found, key=lambda p: (str(read_manifest(p).get("created", "")), p.name))


def resolve(store: Path, ref: str) -> Path:
    """A version by folder path, id, unique id prefix (at least `MIN_PREFIX` characters) or pipeline
    name (its newest version); `StoreError` naming what was looked for."""
    path = Path(ref)
    if path.is_dir() and (path / MANIFEST).exists():
        return path
    every = versions(store)
    if len(ref) >= MIN_PREFIX:
        by_id = [p for p in every if p.name.startswith(ref)]
        if len(by_id) == 1:
            return by_id[0]
        if len(by_id) > 1:
            raise StoreError(
                f"{ref!r} is the prefix of {len(by_id)} versions in {store}: give more of the id"
            )
    by_name = [p for p in every if read_manifest(p).get("name") == ref]
    if by_name:
        return by_name[-1]
    raise StoreError(f"no version {ref!r} in {store} (a folder, an id or its prefix, or a pipeline name)")


def summary(folder: Path) -> dict[str, Any]:
    """A version's manifest without its bulky parts (pipeline text, report, shard list)."""
    m = read_manifest(folder)
    return {
        "id": m.get("id"),
        "name": m.get("name"),
        "path": str(folder),
        "created": m.get("created"),
        "rows": m.get("rows"),
        "shards": len(m.get("shards", [])),
        "parents": m.get("parents", []),
        "pipeline_sha256": m.get("pipeline", {}).get("sha256"),
        "judges": sorted(m.get("judges", {})),
        "counts": m.get("counts", {}),
    }


def diff(a: Path, b: Path, examples: int = 3) -> dict[str, Any]:
    """Rows added and removed from version `a` to `b` (by content hash: prompt, chosen, rejected), the
    counts side by side, and what changed in the pipeline, judges, generators and parents."""
    ma, mb = read_manifest(a), read_manifest(b)
    ha, hb = row_index(a), row_index(b)
    added = [h for h in hb if h not in ha]
    removed = [h for h in ha if h not in hb]
    text_a, text_b = ma.get("pipeline", {}).get("text", ""), mb.get("pipeline", {}).get("text", "")
    pipeline_diff = list(
        difflib.unified_diff(
            text_a.splitlines(), text_b.splitlines(), "a/pipeline", "b/pipeline", lineterm=""
        )
    )
    return {
        "a": {"id": ma.get("id"), "name": ma.get("name"), "rows": ma.get("rows")},
        "b": {"id": mb.get("id"), "name": mb.get("name"), "rows": mb.get("rows")},
        "rows": {"added": len(added), "removed": len(removed), "common": len(hb) - len(added)},
        "added_examples": [hb[h] for h in added[:examples]],
        "removed_examples": [ha[h] for h in removed[:examples]],
        "counts": {"a": ma.get("counts", {}), "b": mb.get("counts", {})},
        "pipeline_changed": text_a != text_b,
        "pipeline_diff": pipeline_diff,
        "judges_changed": ma.get("judges") != mb.get("judges"),
        "generators_changed": ma.get("generators") != mb.get("generators"),
        "parents": {"a": ma.get("parents", []), "b": mb.get("parents", [])},
    }


def row_index(folder: Path) -> dict[str, dict[str, Any]]:
    """Content hash -> (prompt, chosen, rejected) of every distinct row of a version, in order."""
    index: dict[str, dict[str, Any]] = {}
    for row in iter_rows(folder):
        key = row_hash(row["prompt"], row["chosen"], row["rejected"])
        index.setdefault(key, {k: row[k] for k in ("prompt", "chosen", "rejected")})
    return index
