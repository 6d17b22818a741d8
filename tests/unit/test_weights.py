"""The published-weights format: round trips, corruption, commit markers, monotonic versions, pruning.

Every behaviour is checked on a local directory and on fsspec's in-memory filesystem (`memory://`)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from rlfabric.weights import versions as weights
from rlfabric.weights.versions import (
    MANIFEST,
    MARKER,
    VersionConflict,
    VersionNotCommitted,
    WeightsCorrupted,
    latest_committed,
    list_versions,
    load_version,
    prune,
    publish_version,
    verify_version,
    version_dir,
)

_memory_roots = itertools.count()


@pytest.fixture(params=["local", "file-url", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh weights root: a plain local path, a file:// URL, or a memory:// URL (removed afterwards)."""
    if request.param == "local":
        yield str(tmp_path / "weights")
    elif request.param == "file-url":
        yield f"file://{tmp_path}/weights"
    else:
        import fsspec

        url = f"memory://weights-test-{next(_memory_roots)}"
        yield url
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes: fp32, bf16, int64 scalar, a transposed (non-contiguous) view, an empty one."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=gen),
        "layer.0.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "layer.0.bias": torch.randn(16, generator=gen).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "transposed": torch.randn(8, 4, generator=gen).t(),
        "empty": torch.zeros(0, 3),
        "mask": torch.rand(5, generator=gen) > 0.5,
    }


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert got[name].device.type == "cpu"
        assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def local_dir(root: str, version: int) -> Path:
    path = version_dir(root, version)
    assert "://" not in path
    return Path(path)


def fs_for(root: str) -> Any:
    from fsspec.core import url_to_fs

    return url_to_fs(root)[0]


# --- round trips ---------------------------------------------------------------------------------------


def test_round_trip_is_bitwise(root: str) -> None:
    want = state_dict()
    published = publish_version(root, 1, want, metadata={"step": 10, "model": {"hidden": 16}})
    assert_bitwise_equal(load_version(root, 1), want)
    manifest = verify_version(root, 1)
    assert manifest.policy_version == 1
    assert manifest.metadata == {"step": 10, "model": {"hidden": 16}}
    assert manifest.tensors["layer.0.weight"].dtype == "BF16"
    assert manifest.tensors["transposed"].shape == [4, 8]
    assert published.total_bytes == manifest.total_bytes
    assert published.path == version_dir(root, 1)
    assert published.num_files == 1


def test_many_shards_keep_each_file_within_shard_bytes(root: str) -> None:
    want = {f"w{i}": torch.randn(32, 8) for i in range(10)}  # 1 KiB each
    published = publish_version(root, 1, want, shard_bytes=2048)
    names = [f.name for f in published.manifest.files]
    assert names == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert all(f.size < 2048 + 1024 for f in published.manifest.files)  # data <= 2 KiB plus the header
    assert_bitwise_equal(load_version(root, 1), want)


def test_a_tensor_bigger_than_the_shard_size_gets_a_shard_of_its_own(root: str) -> None:
    want = {"small": torch.randn(4), "big": torch.randn(1000), "tail": torch.randn(4)}
    published = publish_version(root, 1, want, shard_bytes=64)
    files = {name: entry.file for name, entry in published.manifest.tensors.items()}
    assert len(set(files.values())) == 3
    assert_bitwise_equal(load_version(root, 1), want)


def test_tied_tensors_are_written_once_per_name_and_load_independent(root: str) -> None:
    embedding = torch.randn(50, 8)
    want = {"embed_tokens.weight": embedding, "lm_head.weight": embedding, "row": embedding[3]}
    publish_version(root, 1, want)
    got = load_version(root, 1)
    assert_bitwise_equal(got, want)
    assert got["embed_tokens.weight"].data_ptr() != got["lm_head.weight"].data_ptr()
    assert embedding.data_ptr() == want["lm_head.weight"].data_ptr()  # the caller's tensors are untouched


def test_shards_are_standard_safetensors_files(tmp_path: Path) -> None:
    """vLLM and transformers read the version directory directly: each shard must open with safetensors."""
    want = state_dict()
    publish_version(tmp_path, 3, want, shard_bytes=512)
    directory = local_dir(str(tmp_path), 3)
    seen: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            seen |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is no dict
    assert_bitwise_equal({name: seen[name] for name in want}, want)


def test_the_module_imports_without_torch() -> None:
    code = "import sys, rlfabric.weights.versions; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- corruption and commit markers ---------------------------------------------------------------------


def flip_one_byte(root: str, version: int, name: str, offset: int = -1) -> None:
    fs = fs_for(root)
    path = f"{version_dir(root, version)}/{name}"
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0x01
    fs.pipe_file(path, bytes(data))


def test_a_flipped_byte_is_reported_naming_the_file(root: str) -> None:
    published = publish_version(root, 1, {f"w{i}": torch.randn(64) for i in range(4)}, shard_bytes=256)
    victim = published.manifest.files[2].name
    flip_one_byte(root, 1, victim)
    with pytest.raises(WeightsCorrupted, match=victim):
        verify_version(root, 1)
    with pytest.raises(WeightsCorrupted, match=victim):
        load_version(root, 1)
    assert latest_committed(root) == 1  # still listed: corruption is the reader's to refuse, loudly


def test_a_truncated_or_missing_file_is_reported(root: str) -> None:
    published = publish_version(root, 1, {"a": torch.randn(64), "b": torch.randn(64)}, shard_bytes=256)
    first, second = (f.name for f in published.manifest.files)
    fs = fs_for(root)
    directory = version_dir(root, 1)
    fs.pipe_file(f"{directory}/{first}", fs.cat_file(f"{directory}/{first}")[:-4])
    fs.rm_file(f"{directory}/{second}")
    with pytest.raises(WeightsCorrupted, match=f"{first}|{second}"):
        load_version(root, 1, verify=False)
    with pytest.raises(WeightsCorrupted, match=f"{first}|{second}"):
        verify_version(root, 1)


def test_a_version_copied_under_another_number_is_refused(root: str) -> None:
    publish_version(root, 1, state_dict())
    fs = fs_for(root)
    fs.makedirs(version_dir(root, 2), exist_ok=True)
    for name in (MANIFEST, MARKER):
        fs.pipe_file(f"{version_dir(root, 2)}/{name}", fs.cat_file(f"{version_dir(root, 1)}/{name}"))
    assert latest_committed(root) == 2
    with pytest.raises(WeightsCorrupted, match="describes version 1"):
        load_version(root, 2)


def test_a_manifest_that_does_not_match_the_marker_is_refused(root: str) -> None:
    publish_version(root, 1, state_dict())
    fs = fs_for(root)
    path = f"{version_dir(root, 1)}/{MANIFEST}"
    manifest = json.loads(fs.cat_file(path))
    manifest["metadata"] = {"forged": True}
    fs.pipe_file(path, json.dumps(manifest).encode())
    with pytest.raises(WeightsCorrupted, match=MANIFEST):
        load_version(root, 1, verify=False)


def test_without_a_marker_a_version_is_not_committed_and_not_loadable(root: str) -> None:
    publish_version(root, 1, state_dict(1))
    publish_version(root, 2, state_dict(2))
    fs_for(root).rm_file(f"{version_dir(root, 2)}/{MARKER}")
    assert latest_committed(root) == 1
    assert [(v.version, v.committed) for v in list_versions(root)] == [(1, True), (2, False)]
    with pytest.raises(VersionNotCommitted):
        load_version(root, 2)
    with pytest.raises(VersionNotCommitted):
        verify_version(root, 2)
    with pytest.raises(VersionNotCommitted):
        load_version(root, 9)


def test_a_crash_before_the_marker_leaves_the_previous_version_intact(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = state_dict(1)
    publish_version(root, 1, want)

    def crash(*args: object) -> float:
        raise RuntimeError("killed after writing the shards and before the marker")

    monkeypatch.setattr(weights, "_commit", crash)
    with pytest.raises(RuntimeError, match="killed"):
        publish_version(root, 2, state_dict(2))
    monkeypatch.undo()
    assert latest_committed(root) == 1
    assert_bitwise_equal(load_version(root, 1), want)
    publish_version(root, 2, state_dict(3))  # the leftover of the crashed attempt is replaced
    assert_bitwise_equal(load_version(root, 2), state_dict(3))


def test_empty_root_has_no_versions(root: str) -> None:
    assert latest_committed(root) is None
    assert list_versions(root) == []
    assert prune(root, keep=2) == []


# --- versions ------------------------------------------------------------------------------------------


def test_versions_must_increase(root: str) -> None:
    publish_version(root, 5, state_dict())
    for stale in (3, 5):
        with pytest.raises(VersionConflict, match="not newer than the latest committed version 5"):
            publish_version(root, stale, state_dict())
    assert latest_committed(root) == 5
    publish_version(root, 6, state_dict())
    assert [v.version for v in list_versions(root)] == [5, 6]


@pytest.mark.parametrize("version", [-1, 1.0, True, "3"])
def test_bad_versions_are_refused(tmp_path: Path, version: object) -> None:
    with pytest.raises(weights.InvalidArgument):
        publish_version(tmp_path, version, state_dict())  # type: ignore[arg-type]


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(weights.InvalidArgument, match="empty"):
        publish_version(tmp_path, 1, {})
    with pytest.raises(weights.InvalidArgument, match="shard_bytes"):
        publish_version(tmp_path, 1, state_dict(), shard_bytes=0)
    with pytest.raises(weights.InvalidArgument, match="reserved"):
        publish_version(tmp_path, 1, {"__metadata__": torch.zeros(2)})
    with pytest.raises(weights.InvalidArgument, match="JSON"):
        publish_version(tmp_path, 1, state_dict(), metadata={"bad": object()})
    with pytest.raises(weights.InvalidArgument, match="complex"):
        publish_version(tmp_path, 1, {"c": torch.zeros(2, dtype=torch.complex64)})
    assert list_versions(tmp_path) == []


def test_prune_keeps_the_newest_committed_and_drops_old_leftovers(root: str) -> None:
    for version in range(1, 6):
        publish_version(root, version, {"w": torch.full((4,), float(version))})
    fs = fs_for(root)
    fs.rm_file(f"{version_dir(root, 2)}/{MARKER}")  # an old crashed publish
    fs.makedirs(version_dir(root, 7), exist_ok=True)
    fs.pipe_file(f"{version_dir(root, 7)}/partial.safetensors", b"in progress")  # a publish under way
    assert prune(root, keep=2) == [1, 2, 3]
    assert [(v.version, v.committed) for v in list_versions(root)] == [(4, True), (5, True), (7, False)]
    assert torch.equal(load_version(root, 5)["w"], torch.full((4,), 5.0))
    assert prune(root, keep=1) == [4]
    with pytest.raises(weights.InvalidArgument):
        prune(root, keep=0)


def test_version_dir_is_a_local_path_for_local_roots(tmp_path: Path) -> None:
    assert version_dir(tmp_path, 7) == str(tmp_path / "v000007")
    assert version_dir(f"file://{tmp_path}", 7) == str(tmp_path / "v000007")
    assert version_dir("memory://run/weights", 1234567) == "memory:///run/weights/v1234567"


def test_local_publish_leaves_no_temporary_files(tmp_path: Path) -> None:
    published = publish_version(tmp_path, 1, state_dict(), shard_bytes=512)
    names = sorted(p.name for p in local_dir(str(tmp_path), 1).iterdir())
    assert names == sorted([MANIFEST, MARKER, *(f.name for f in published.manifest.files)])
    assert (local_dir(str(tmp_path), 1) / MARKER).read_text().strip() == weights.hashlib.sha256(
        (local_dir(str(tmp_path), 1) / MANIFEST).read_bytes()
    ).hexdigest()
    assert published.timings.total_s > 0
    assert published.timings.write_s > 0 and published.timings.hash_s > 0
