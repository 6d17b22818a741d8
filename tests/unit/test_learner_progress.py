"""`up`'s view of an offline learner it waits for (a warm start, an SFT or reward-model run file): the
rows of its metrics.jsonl as they are written, and the line it says when the learner fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfabric.local.warm_start import LearnerProgress, last_line


def append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def row(step: int, loss: float) -> str:
    return json.dumps({"step": step, "loss": loss, "token_accuracy": 0.5, "tokens": 100}) + "\n"


def test_a_line_at_every_tenth_and_the_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "metrics.jsonl"
    shown = LearnerProgress(metrics, 20, progress=False)
    shown.poll()  # no file yet: nothing
    append(metrics, "".join(row(step, 1.0 / step) for step in range(1, 4)))
    append(metrics, row(4, 0.25)[:10])  # a row still being written waits for the next poll
    shown.poll()
    assert shown.step == 3
    append(metrics, row(4, 0.25)[10:] + "".join(row(step, 1.0 / step) for step in range(5, 21)))
    shown.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [f"step {s}/20" for s in range(2, 21, 2)]
    assert lines[0] == "  step 2/20: loss=0.5 token_accuracy=0.5"
    assert shown.step == 20


def test_a_run_that_ends_before_its_steps_says_where_it_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SFT run ends with its epochs, far short of `train.steps` (an upper bound): a line every
    `LINE_EVERY_S`, and its last step at the end."""
    metrics = tmp_path / "metrics.jsonl"
    shown = LearnerProgress(metrics, 10_000, progress=False)
    append(metrics, row(1, 1.0))
    shown.poll()
    assert capsys.readouterr().out == ""  # not yet a tenth, nor LINE_EVERY_S
    monkeypatch.setattr(LearnerProgress, "LINE_EVERY_S", 0.0)
    append(metrics, row(2, 0.5))
    shown.poll()
    assert capsys.readouterr().out == "  step 2/10000: loss=0.5 token_accuracy=0.5\n"
    monkeypatch.setattr(LearnerProgress, "LINE_EVERY_S", 3600.0)
    append(metrics, row(3, 0.25))
    shown.close()
    assert capsys.readouterr().out == "  step 3/10000: loss=0.25 token_accuracy=0.5\n"


def test_a_resumed_run_starts_at_its_latest_step(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(row(step, 0.1) for step in range(1, 51)))
    shown = LearnerProgress(metrics, 100, progress=True)
    shown.poll()
    assert shown.bar.n == 50
    shown.close()


def test_a_failed_learner_is_told_by_its_last_exception_line() -> None:
    tail = [
        '[rank0]:   File "hub.py", line 620, in cached_files',
        "[rank0]: OSError: We couldn't connect to 'https://huggingface.co' to load the files.",
        "[rank0]: Check your internet connection.",
        "",
    ]
    assert last_line(tail) == "OSError: We couldn't connect to 'https://huggingface.co' to load the files."
    assert last_line(["loading", "killed by the OOM killer", ""]) == "killed by the OOM killer"
    assert last_line([]) == "no output"
