"""Packaging: the wheel's package list covers every folder, and light services import without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_code_folder_is_a_package() -> None:
    """setuptools' package finder ships only folders with an `__init__.py`: a folder of modules without one
    would be missing from the wheel."""
    src = ROOT / "src" / "rlfabric"
    folders = {py.parent for py in src.rglob("*.py") if "__pycache__" not in py.parts}
    assert sorted(str(f.relative_to(src)) for f in folders if not (f / "__init__.py").exists()) == []


def test_coordinator_and_reward_import_without_torch() -> None:
    code = (
        "import sys, rlfabric.cli, rlfabric.coordinator.config, rlfabric.reward.config\n"
        "import rlfabric.runspec\n"
        "import importlib.util\n"
        "for m in ('rlfabric.reward.main', 'rlfabric.reward.server', 'rlfabric.coordinator.main'):\n"
        "    if importlib.util.find_spec(m): importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'vllm', 'transformers'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_test_module_names_are_unique() -> None:
    """pytest imports test folders without `__init__.py` by basename (rootdir-relative "prepend" mode): two
    test modules with one name make the whole collection fail ("import file mismatch")."""
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name != "conftest.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
