"""The native-kernel cache trusts only what the user alone can write, and a library that does
not match the sources turns the kernels off instead of failing model load."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tinyvllm.native import abi
from tinyvllm.native import build as build_mod
from tinyvllm.native.ops import NativeCpuOps

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or build_mod.unsupported_reason() is not None,
    reason="needs gcc and a CPU the native kernels support",
)


def compile_library(
    target: Path, symbols: list[str], marker: Path | None = None, version: int = abi.ABI_VERSION
) -> None:
    """A tiny shared library exporting `symbols` (`tv_abi_version` returning `version`); with
    `marker`, its constructor writes that file (what a planted library would do when loaded)."""
    body = "".join(
        f"int {name}(void) {{ return {version}; }}\n"
        if name == "tv_abi_version"
        else f"void {name}(void) {{}}\n"
        for name in symbols
    )
    if marker is not None:
        body += (
            "#include <stdio.h>\n__attribute__((constructor)) static void planted(void) "
            f'{{ FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    source = target.with_suffix(".c")
    source.write_text(body)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    source.unlink()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A fresh cache dir, and a fake compiler that builds a stub with every exported symbol
    (recording where it built)."""
    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    stub = tmp_path / "stub" / "stub.so"
    compile_library(stub, build_mod.exported_symbols())
    builds: list[Path] = []

    def fake_build(target: Path) -> None:
        builds.append(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stub, target)

    monkeypatch.setattr(build_mod, "build", fake_build)
    return {"path": build_mod.library_path(), "builds": builds, "marker": tmp_path / "ran"}


def test_exported_symbols_are_found_in_the_sources() -> None:
    names = build_mod.exported_symbols()
    assert {"tv_linear", "tv_rms_norm", "tv_llama_decode", "tv_dequant_rows"} <= set(names)


def test_new_cache_dir_is_private(cache: dict) -> None:
    path: Path = cache["path"]
    assert build_mod.load_library() is not None
    assert cache["builds"] == [path]
    assert path.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o666, 0o664], ids=["world", "group"])
def test_planted_library_writable_by_others_is_not_loaded(cache: dict, mode: int) -> None:
    path: Path = cache["path"]
    path.parent.mkdir(mode=0o700, parents=True)
    compile_library(path, build_mod.exported_symbols(), marker=cache["marker"])
    path.chmod(mode)
    assert build_mod.load_library() is not None  # the stub, built privately
    assert not cache["marker"].exists(), "the planted library's constructor ran"
    (built,) = cache["builds"]
    assert built.parent != path.parent and not built.exists()  # temporary, already gone


def test_cache_dir_writable_by_others_is_not_used(cache: dict) -> None:
    path: Path = cache["path"]
    compile_library(path, build_mod.exported_symbols(), marker=cache["marker"])
    path.parent.chmod(0o777)
    assert build_mod.load_library() is not None
    assert not cache["marker"].exists()


def test_library_of_another_user_is_not_loaded(
    cache: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path: Path = cache["path"]
    path.parent.mkdir(mode=0o700, parents=True)
    compile_library(path, build_mod.exported_symbols(), marker=cache["marker"])
    owner = os.getuid()
    monkeypatch.setattr(build_mod.os, "getuid", lambda: owner + 1)
    with caplog.at_level(logging.WARNING, logger=build_mod.__name__):
        assert build_mod.load_library() is not None
    assert not cache["marker"].exists()
    assert f"belongs to user id {owner}" in caplog.text


def test_library_missing_a_symbol_turns_native_off(
    cache: dict, caplog: pytest.LogCaptureFixture
) -> None:
    path: Path = cache["path"]
    path.parent.mkdir(mode=0o700, parents=True)
    compile_library(path, [s for s in build_mod.exported_symbols() if s != "tv_rope"])
    with caplog.at_level(logging.WARNING, logger=build_mod.__name__):
        assert NativeCpuOps.load() is None  # was an AttributeError at model load
    (record,) = [r for r in caplog.records if r.name == build_mod.__name__]
    assert "lacks tv_rope" in record.getMessage()


def test_library_that_does_not_load_turns_native_off(cache: dict) -> None:
    path: Path = cache["path"]
    path.parent.mkdir(mode=0o700, parents=True)
    path.write_bytes(b"not an ELF file")
    assert build_mod.load_library() is None


def test_library_of_another_abi_version_is_rebuilt_once(
    cache: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached library compiled for another ABI (a stale cache, a hand-copied file) would be
    called with the wrong signatures: it is rebuilt, and the rebuilt one is used."""
    path: Path = cache["path"]
    path.parent.mkdir(mode=0o700, parents=True)
    compile_library(path, build_mod.exported_symbols(), version=abi.ABI_VERSION - 1)
    with caplog.at_level(logging.INFO, logger=build_mod.__name__):
        lib = build_mod.load_library()
    assert lib is not None and lib.tv_abi_version() == abi.ABI_VERSION
    assert len(cache["builds"]) == 1
    assert f"built for native ABI version {abi.ABI_VERSION - 1}" in caplog.text
    # The rebuilt library replaced the stale one in the cache (the next process loads it).
    assert path.exists() and not path.with_name(f"{path.stem}.rebuilt{path.suffix}").exists()


def test_abi_mismatch_after_the_rebuild_falls_back_to_torch(
    cache: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Sources whose TV_ABI_VERSION disagrees with abi.py: one rebuild, then torch (one
    warning), never a call through mismatched signatures."""
    monkeypatch.setattr(abi, "ABI_VERSION", abi.ABI_VERSION + 1)  # the stubs report the old
    with caplog.at_level(logging.WARNING, logger=build_mod.__name__):
        assert build_mod.load_library() is None
    assert len(cache["builds"]) == 2  # the first build, then one rebuild
    (record,) = [r for r in caplog.records if r.name == build_mod.__name__]
    assert "native CPU kernels off" in record.getMessage()
    assert f"needs {abi.ABI_VERSION}" in record.getMessage()
