"""A dataset read and a tokenizer load in two threads of a fresh process (as a coordinator resuming two
runs does: one run's prompts read while the other run's model is checked) both succeed: without
`rlfabric.runtime.hf.HF_LOCK` the dataset read met a half-imported `transformers` and failed with
AttributeError (4 times in 4 here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys, threading
from pathlib import Path
from rlfabric.coordinator.checks import model_issues
from rlfabric.data import read_records
from rlfabric.runspec import RunSpec

spec = RunSpec.model_validate(json.loads(sys.argv[1]))
errors, rows = [], []

def read():
    try:
        rows.extend(read_records(Path(spec.dataset.path)))
    except Exception as exc:
        errors.append(f"dataset: {exc!r} ({exc.__context__!r})")

def check():
    try:
        errors.extend(f"model: {issue}" for issue in model_issues(spec))
    except Exception as exc:
        errors.append(f"model: {exc!r}")

threads = [threading.Thread(target=read), threading.Thread(target=check)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"errors": errors, "rows": len(rows)}))
"""


def test_a_dataset_read_beside_a_first_tokenizer_load(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(5)))
    spec = {"name": "r", "model": {"path": str(tiny_model_dir)}, "dataset": {"path": str(data)}}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(spec)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {"errors": [], "rows": 5}
