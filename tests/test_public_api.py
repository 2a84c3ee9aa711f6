"""What a front end may import from tinyvllm, checked without importing anything (ast)."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The public modules: the package itself, the statistics types, chat sessions, the model
# catalog and the command line (whose `tinyvllm tui` flags the TUI shares). Everything else
# (engine/, core/, runner/, ...) may change shape between versions.
PUBLIC_MODULES = (
    "tinyvllm",
    "tinyvllm.stats",
    "tinyvllm.chat",
    "tinyvllm.catalog",
    "tinyvllm.cli",
)


def public_names(module: str) -> set[str]:
    """The module's `__all__`, read from its source."""
    parts = module.split(".")
    path = ROOT.joinpath(*parts, "__init__.py")
    if not path.exists():
        path = ROOT.joinpath(*parts[:-1], parts[-1] + ".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no literal __all__")


def tinyvllm_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every tinyvllm import in `path` (any depth)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return [f for f in found if f[1] == "tinyvllm" or f[1].startswith("tinyvllm.")]


def test_tui_imports_only_public_tinyvllm_names() -> None:
    public = {m: public_names(m) for m in PUBLIC_MODULES}
    bad = []
    for path in sorted((ROOT / "tui").rglob("*.py")):
        for line, module, names in tinyvllm_imports(path):
            where = f"tui/{path.relative_to(ROOT / 'tui')}:{line}"
            if module not in public:
                bad.append(f"{where} imports {module}")
            else:
                bad += [f"{where} imports {module}.{n}" for n in names if n not in public[module]]
    assert not bad, f"the TUI reaches past tinyvllm's public modules {PUBLIC_MODULES}: {bad}"


def test_checker_sees_private_imports(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text(
        "import tinyvllm.engine.engine\n"
        "def f():\n    from tinyvllm.core.kv_cache_manager import BlockInfo\n"
    )
    assert [(m, n) for _, m, n in tinyvllm_imports(source)] == [
        ("tinyvllm.engine.engine", []),
        ("tinyvllm.core.kv_cache_manager", ["BlockInfo"]),
    ]


def test_stats_types_are_public_and_torch_free() -> None:
    code = (
        "import sys, tinyvllm, tinyvllm.stats as s\n"
        "assert tinyvllm.EngineStats is s.EngineStats and tinyvllm.BlockInfo is s.BlockInfo\n"
        "assert tinyvllm.LatencySummary is s.LatencySummary\n"
        "assert 'torch' not in sys.modules, 'tinyvllm.stats imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_get_stats_is_typed() -> None:
    from tinyvllm import LLM, AsyncLLM
    from tinyvllm.engine.engine import Engine
    from tinyvllm.stats import EngineStats

    for cls in (LLM, AsyncLLM, Engine):
        hints = typing.get_type_hints(cls.get_stats)
        assert hints == {"include_blocks": bool, "return": EngineStats}, cls
