"""The version store: the id is stable across identical builds and changes with the content, a version
is never overwritten, `verify` catches a changed byte, a changed manifest and a stray shard, `diff`
counts rows by content, and `rlfabric.data` reads a version's shards alone after verifying it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfabric.data import DatasetVersionError, Source, dataset_version, read_records
from rlfabric.prefs import store
from rlfabric.prefs.types import PrefPair

FIELDS = {"name": "demo", "pipeline": {"text": "name = 'demo'", "sha256": "x"}, "parents": []}


def pairs(n: int, start: int = 0) -> list[PrefPair]:
    return [PrefPair(f"prompt {i}", f"good {i}", f"bad {i}", {"row": i, "votes": {"j": "chosen"}})
            for i in range(start, start + n)]  # fmt: skip


def write(root: Path, rows: list[PrefPair], **kwargs: object) -> store.Written:
    options: dict[str, object] = {"fields": FIELDS, "report": {"rows": len(rows)}, "shard_rows": 2}
    options.update(kwargs)
    return store.write_version(root, rows, **options)  # type: ignore[arg-type]


def test_identical_builds_get_the_same_id_and_the_version_is_kept(tmp_path: Path) -> None:
    first = write(tmp_path, pairs(5), build={"seconds": 1.0})
    again = write(tmp_path, pairs(5), build={"seconds": 9.0})  # volatile notes differ, content does not
    assert again.id == first.id and again.existed and not first.existed
    assert again.manifest["created"] == first.manifest["created"]  # the first one's manifest, untouched
    assert [p.name for p in tmp_path.iterdir()] == [first.id]  # no temporary folder left behind
    other = write(tmp_path, pairs(4))
    assert other.id != first.id
    assert store.verify(first.path).ok and store.verify(other.path).ok


def test_layout_and_manifest(tmp_path: Path) -> None:
    version = write(tmp_path, pairs(5), dropped=[{"rule": "identical"}], report_md="# r\n")
    m = version.manifest
    assert sorted(p.name for p in (version.path / "data").iterdir()) == [
        "shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]  # fmt: skip
    assert [s["rows"] for s in m["shards"]] == [2, 2, 1] and m["rows"] == 5
    assert set(m["files"]) == {"dropped.jsonl", "report.json", "report.md"}
    assert m["id"] == store.version_id(m) == version.path.name and m["format"] == store.FORMAT
    row = next(store.iter_rows(version.path))
    assert row == {"prompt": "prompt 0", "chosen": "good 0", "rejected": "bad 0",
                   "meta": {"row": 0, "votes": {"j": "chosen"}}}  # fmt: skip


@pytest.mark.parametrize("damage", ["shard_byte", "manifest_rows", "stray_shard", "missing_report"])
def test_verify_fails_after_any_change(tmp_path: Path, damage: str) -> None:
    version = write(tmp_path, pairs(3))
    folder = version.path
    if damage == "shard_byte":
        shard = folder / "data" / "shard-00000.jsonl"
        shard.chmod(0o644)
        data = bytearray(shard.read_bytes())
        data[10] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "manifest_rows":
        manifest = folder / "manifest.json"
        manifest.chmod(0o644)
        m = json.loads(manifest.read_text())
        m["rows"] = 2
        m["shards"][0]["rows"] = 1
        manifest.write_text(json.dumps(m))
    elif damage == "stray_shard":
        (folder / "data" / "shard-00009.jsonl").write_text('{"prompt": "x"}\n')
    else:
        (folder / "report.md").unlink()
    checked = store.verify(folder)
    assert not checked.ok and checked.problems, damage


def test_an_existing_version_that_does_not_verify_is_not_overwritten(tmp_path: Path) -> None:
    version = write(tmp_path, pairs(3))
    shard = version.path / "data" / "shard-00000.jsonl"
    shard.chmod(0o644)
    shard.write_text("tampered\n")
    with pytest.raises(store.StoreError, match="does not verify"):
        write(tmp_path, pairs(3))
    assert shard.read_text() == "tampered\n"


def test_resolve_by_prefix_name_and_folder(tmp_path: Path) -> None:
    a = write(tmp_path, pairs(2))
    b = write(tmp_path, pairs(3))
    assert store.resolve(tmp_path, a.id[:8]) == a.path
    assert store.resolve(tmp_path, str(b.path)) == b.path
    assert store.resolve(tmp_path, "demo") in (a.path, b.path)
    with pytest.raises(store.StoreError, match="no version"):
        store.resolve(tmp_path, "nothing-like-this")


def test_diff_counts_rows_by_content_and_pipeline_changes(tmp_path: Path) -> None:
    a = write(tmp_path, pairs(4))
    changed = {**FIELDS, "pipeline": {"text": "name = 'demo'\n[hygiene]", "sha256": "y"}}
    b = write(tmp_path, pairs(4, start=2), fields=changed)
    result = store.diff(a.path, b.path)
    assert result["rows"] == {"added": 2, "removed": 2, "common": 2}
    assert [r["prompt"] for r in result["added_examples"]] == ["prompt 4", "prompt 5"]
    assert result["pipeline_changed"] and "+[hygiene]" in result["pipeline_diff"]


def test_rlfabric_data_reads_only_the_shards_of_a_verified_version(tmp_path: Path) -> None:
    version = write(tmp_path, pairs(5), dropped=[{"rule": "identical", "row": {"prompt": "p"}}])
    rows = read_records(Source("dataset", str(version.path), "train"))
    assert [r["prompt"] for r in rows] == [f"prompt {i}" for i in range(5)]
    assert set(rows[0]) == {"prompt", "chosen", "rejected", "meta"}
    assert dataset_version(str(version.path)) == version.id
    assert dataset_version(str(tmp_path)) is None
    assert len(read_records(Source("dataset", str(version.path), "train[:2]"))) == 2
    shard = version.path / "data" / "shard-00001.jsonl"
    shard.chmod(0o644)
    shard.write_text(shard.read_text().replace("good 2", "good 9"))
    with pytest.raises(DatasetVersionError, match=r"^dataset.path .*does not verify.*shard-00001"):
        read_records(Source("dataset", str(version.path), "train"))
