"""Layering read from the source with ast (nothing is imported): subpackages of tinyvllm/ and
its top-level modules import each other one way only, and the torch-free parts (core/,
catalog/, `import tinyvllm`) never load torch, not even through another module."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH_FREE = ("tinyvllm", "tinyvllm.core", "tinyvllm.catalog")
# tinyvllm never depends on its TUI; `tinyvllm tui` hands over to it inside the command.
TUI_IMPORTS_ALLOWED = {("tinyvllm.cli.commands", "tinyvllm_tui")}


class ImportGraph:
    """Every module of a package with the modules it imports, all of them and those run at
    import time (module level, class bodies, `try` / `if` blocks; not `if TYPE_CHECKING:`)."""

    def __init__(self, package_dir: Path) -> None:
        self.top = package_dir.name
        self.files: dict[str, Path] = {}
        for path in sorted(package_dir.rglob("*.py")):
            parts = path.relative_to(package_dir.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self.files[name] = path
        self.all: dict[str, set[str]] = {}
        self.eager: dict[str, set[str]] = {}
        for name, path in self.files.items():
            tree = ast.parse(path.read_text(), str(path))
            self.all[name] = set(self._imports(tree, name, path, eager_only=False))
            self.eager[name] = set(self._imports(tree, name, path, eager_only=True))

    def _imports(self, tree: ast.AST, name: str, path: Path, eager_only: bool) -> Iterator[str]:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _walk(tree, eager_only):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield from self._executed(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                yield from self._executed(base)
                for alias in node.names:
                    if f"{base}.{alias.name}" in self.files:  # `from pkg import submodule`
                        yield f"{base}.{alias.name}"

    def _executed(self, dotted: str) -> Iterator[str]:
        """`import a.b.c` runs a/__init__, a/b/__init__ and a/b/c; outside modules count by
        their top-level name (`torch`)."""
        parts = dotted.split(".")
        if parts[0] != self.top:
            yield parts[0]
            return
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) in self.files:
                yield ".".join(parts[:i])

    def unit(self, module: str) -> str:
        """The layer a module belongs to: its subpackage, or itself for top-level modules."""
        parts = module.split(".")
        return ".".join(parts[:2])

    def loaded_at_import(self, module: str) -> dict[str, str]:
        """Everything `import module` loads, each with the module that imports it."""
        seen: dict[str, str] = {}
        todo = [module]
        while todo:
            current = todo.pop()
            for dep in self.eager.get(current, ()):
                if dep not in seen:
                    seen[dep] = current
                    todo.append(dep)
        return seen

    def unit_cycles(self) -> list[str]:
        edges: dict[str, dict[str, str]] = {}
        for module, deps in self.all.items():
            for dep in deps:
                src, dst = self.unit(module), self.unit(dep)
                if dep in self.files and src != dst and src != self.top and dst != self.top:
                    edges.setdefault(src, {}).setdefault(dst, f"{module} imports {dep}")
        cycles: dict[frozenset[str], str] = {}
        for src in sorted(edges):
            for dst, why in sorted(edges[src].items()):
                back = _path(edges, dst, src)
                if back is not None and frozenset((src, dst)) not in cycles:
                    cycles[frozenset((src, dst))] = f"{src} -> {dst} ({why}), back: {back}"
        return list(cycles.values())


def _walk(tree: ast.AST, eager_only: bool) -> Iterator[ast.AST]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                yield child
                yield from _walk(child, eager_only)
            continue
        if eager_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        yield from _walk(node, eager_only)


def _path(edges: dict[str, dict[str, str]], start: str, goal: str) -> list[str] | None:
    """A chain of units from start to goal (breadth first), or None."""
    parents: dict[str, str] = {start: start}
    todo = [start]
    while todo:
        node = todo.pop(0)
        if node == goal:
            chain = [node]
            while chain[-1] != start:
                chain.append(parents[chain[-1]])
            return chain[::-1]
        for nxt in sorted(edges.get(node, {})):
            if nxt not in parents:
                parents[nxt] = node
                todo.append(nxt)
    return None


def _sources() -> dict[str, str]:
    folders = ("tinyvllm", "tui", "benchmarks")
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


@pytest.mark.parametrize(
    ("pattern", "owner"),
    [
        (r"/proc/cpuinfo", "tinyvllm/utils/cpu.py"),
        (r"^\s*(import|from) platformdirs\b", "tinyvllm/utils/dirs.py"),
    ],
)
def test_host_facts_have_one_reader(pattern: str, owner: str) -> None:
    """CPU features and user dirs are looked up in one module each; the rest asks it."""
    found = re.compile(pattern, re.MULTILINE)
    assert [name for name, text in _sources().items() if found.search(text)] == [owner]


def test_cpuinfo_reads_the_first_processor(tmp_path: Path) -> None:
    from tinyvllm.utils.cpu import cpuinfo

    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
    )
    info = cpuinfo(path)
    assert info is not None and info["model name"] == "Some CPU"
    assert info["flags"].split() == ["fpu", "avx2", "avx512_bf16"]
    assert cpuinfo(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(ROOT / "tinyvllm")


def test_no_import_cycles_between_subpackages_and_top_level_modules(graph: ImportGraph) -> None:
    assert graph.unit_cycles() == []


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_parts_never_load_torch(graph: ImportGraph, module: str) -> None:
    members = [m for m in graph.files if m == module or m.startswith(module + ".")]
    if module == graph.top:
        members = [module]  # `import tinyvllm` only; its subpackages have their own rules
    for member in members:
        loaded = graph.loaded_at_import(member)
        if "torch" in loaded:
            chain = ["torch"]
            while chain[-1] != member:
                chain.append(loaded[chain[-1]])
            pytest.fail(f"importing {member} loads torch: {' <- '.join(chain)}")


def test_tinyvllm_never_imports_its_tui(graph: ImportGraph) -> None:
    found = {
        (module, dep)
        for module, deps in graph.all.items()
        for dep in deps
        if dep.split(".")[0] in {"tinyvllm_tui", "textual"}
    }
    eager = {(m, d) for m, d in found if d in graph.eager[m]}
    assert eager == set(), "tinyvllm must load its TUI only inside the `tui` command"
    assert found <= TUI_IMPORTS_ALLOWED


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for folder in ("a", "b"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from . import y\nimport torch.nn\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from pkg.b import z\n")
    (pkg / "b" / "z.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a.x\n"
        "class C:\n    from pkg.a import y\n"
    )
    g = ImportGraph(pkg)
    assert g.eager["pkg.a.x"] == {"pkg", "pkg.a", "pkg.a.y", "torch"}
    assert g.eager["pkg.a.y"] == set() and g.all["pkg.a.y"] == {"pkg", "pkg.b", "pkg.b.z"}
    assert "torch" in g.loaded_at_import("pkg.a.x") and "torch" not in g.loaded_at_import("pkg.b.z")
    assert [c.split(" (")[0] for c in g.unit_cycles()] == ["pkg.a -> pkg.b"]
