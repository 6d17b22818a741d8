"""Dataset errors name the spec field and the problem, never the file's data: a spec's author may point
`dataset.path` at any readable file, and the error text is shown in the run's status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfabric.coordinator.dataset import DatasetError, load_rows
from rlfabric.runspec import DatasetSpec

SECRET = {"aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG", "aws_access_key_id": "AKIAIOSFODNN7EXAMPLE"}
LEAKS = ("aws_secret_access_key", "aws_access_key_id", "wJalrXUtnFEMI", "AKIAIOSFODNN7EXAMPLE")


def failure(path: Path, **spec: str) -> str:
    with pytest.raises(DatasetError) as info:
        load_rows(DatasetSpec(path=str(path), **spec))  # type: ignore[arg-type]
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "field", "problem"),
    [
        ("creds.json", json.dumps(SECRET) + "\n", "dataset.prompt_field", "row 1"),  # the attack: keys echoed
        ("list.jsonl", json.dumps(list(SECRET.values())) + "\n", "dataset.path", "not a JSON object"),
        ("text.jsonl", json.dumps(SECRET["aws_access_key_id"]) + "\n", "dataset.path", "not a JSON object"),
        ("later.jsonl", '{"prompt": "p"}\n' + json.dumps(SECRET) + "\n", "dataset.prompt_field", "row 2"),
        ("broken.jsonl", '{"prompt": "p"}\n{"aws_secret_access_key": AKIAIOSFODNN7EXAMPLE}\n', "dataset.path",
         "line 2 is not JSON"),
    ],
)  # fmt: skip
def test_errors_never_echo_the_data(
    tmp_path: Path, name: str, content: str, field: str, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    message = failure(path)
    assert message.startswith(field) and problem in message
    assert not any(leak in message for leak in LEAKS), message


def test_binary_files_say_so_without_their_bytes(tmp_path: Path) -> None:
    path = tmp_path / "key.jsonl"
    path.write_bytes(b"\xff\xfeAKIAIOSFODNN7EXAMPLE")
    message = failure(path)
    assert "not UTF-8" in message and "AKIA" not in message and "0xff" not in message


def test_unreadable_parquet_says_so_without_its_content(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "creds.parquet"
    path.write_text(json.dumps(SECRET))
    message = failure(path)
    assert "not a readable Parquet file" in message
    assert not any(leak in message for leak in LEAKS), message


def test_a_good_file_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    path.write_text('{"id": "a", "prompt": "p", "answer": 3}\n{"prompt": "q"}\n')
    rows = load_rows(DatasetSpec(path=str(path)))
    assert [(r.prompt_id, r.prompt, r.reference) for r in rows] == [("a", "p", "3"), ("1", "q", "")]
