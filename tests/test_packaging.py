"""The package list in pyproject.toml covers every package folder."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for init in (ROOT / "tinyvllm").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    if (ROOT / "tui" / "__init__.py").exists():
        found.add("tinyvllm_tui")
    for init in (ROOT / "tui").rglob("*/__init__.py"):
        found.add(".".join(("tinyvllm_tui", *init.parent.relative_to(ROOT / "tui").parts)))
    assert found == listed, f"missing from pyproject: {found - listed}; stale: {listed - found}"
