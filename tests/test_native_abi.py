"""native/abi.py is the one Python copy of the library's ABI: it must say what the C++ sources
say (exports, parameter types, struct fields, version), and the decode program's workspace
errors come back as exceptions."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from tinyvllm import LLM
from tinyvllm.native import abi, build
from tinyvllm.native.build import unsupported_reason

_PROTOTYPE = re.compile(r'^(?:extern "C" )?\w+ (tv_\w+)\(([^)]*)\)', re.MULTILINE)


def _sources() -> str:
    return "\n".join(path.read_text() for path in (*build.SOURCES, *build.HEADERS))


def _ctype_of(param: str) -> object:
    """The ctypes class a C parameter declaration needs (pointers of any kind: c_void_p)."""
    if "*" in param:
        return ctypes.c_void_p
    kind = param.split()[-2] if len(param.split()) > 1 else param
    return {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}[kind]


def _struct_fields(name: str) -> list[str]:
    body = re.search(rf"struct {name} \{{(.*?)\n\}};", _sources(), re.DOTALL)
    assert body is not None, name
    fields: list[str] = []
    for decl in re.sub(r"//.*", "", body.group(1)).split(";"):
        if decl.strip():
            first, *rest = decl.split(",")
            fields += [re.findall(r"\w+", first)[-1], *(part.strip() for part in rest)]
    return fields


def test_every_export_is_declared_once() -> None:
    assert sorted(abi.FUNCTIONS) == build.exported_symbols()


def test_declared_parameter_types_match_the_sources() -> None:
    prototypes = {name: params for name, params in _PROTOTYPE.findall(_sources())}
    for name, (_, argtypes) in abi.FUNCTIONS.items():
        params = [p.strip() for p in prototypes[name].split(",") if p.strip() not in ("", "void")]
        expected = [_ctype_of(p) for p in params]
        got = [ctypes.c_void_p if hasattr(t, "contents") else t for t in argtypes]
        assert got == expected, name


def test_struct_layouts_match_the_sources() -> None:
    assert [f for f, _ in abi.TvLayer._fields_] == _struct_fields("TvLayer")
    assert [f for f, _ in abi.TvModel._fields_] == _struct_fields("TvModel")


def test_version_matches_the_sources() -> None:
    (version,) = re.findall(r"#define TV_ABI_VERSION (\d+)", _sources())
    assert int(version) == abi.ABI_VERSION


@pytest.mark.skipif(unsupported_reason() is not None, reason="native kernels unavailable")
def test_decode_program_workspace_is_grown_and_checked(tiny_models) -> None:
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)
    program = llm.engine.runner.decode_program
    assert program is not None
    lib = program.ops.lib
    rows = program._workspace_rows
    assert program._workspace.numel() == lib.tv_llama_workspace_bytes(program._model, rows)

    def step(t: int) -> torch.Tensor:
        ids = torch.arange(5, 5 + t, dtype=torch.int64)
        return program.run(
            ids,
            torch.arange(t, dtype=torch.int64),
            torch.arange(t, dtype=torch.int64),
            torch.tensor([0, t], dtype=torch.int32),
            torch.arange(8, dtype=torch.int32)[None],
        )

    first = step(3)
    program._grow_workspace(1)  # a step larger than the workspace grows it first
    assert torch.equal(step(3), first) and program._workspace_rows == 3
    program._model.workspace_bytes = 16  # C refuses a step its workspace cannot hold
    with pytest.raises(RuntimeError, match="status 1 \\(workspace too small\\)"):
        step(3)
