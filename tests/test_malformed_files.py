"""Malformed checkpoints load into a clean Python exception that names the file: never a
crash signal, a hang or an unbounded allocation.

Each file is loaded (`LLM(path)`) in a subprocess under an address-space limit and a timeout,
several cases per process (imports dominate). The default run covers one case of each kind;
`-m slow` sweeps truncations, offsets, absurd dims and counts, unknown types and byte flips.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf_writer import write_tiny_gguf
from safetensors.torch import load_file, save_file

V = gguf.GGUFValueType
Q8_0 = gguf.GGMLQuantizationType.Q8_0
ADDRESS_SPACE_LIMIT = 6 << 30
# Enough KV for the tiny models, little enough that no case can hide behind a big cache.
LOAD_KWARGS = {"skip_tokenizer_init": True, "max_num_seqs": 4, "kv_cache_memory_bytes": 32 << 20}

CHILD = r"""
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from tinyvllm import LLM
for line in open(sys.argv[2]):
    case = json.loads(line)
    print(json.dumps({"name": case["name"], "started": True}), flush=True)
    try:
        llm = LLM(case["path"], device="cpu", **case["kwargs"])
        result = {"ok": True, "max_model_len": llm.engine.config.model.max_model_len}
        del llm
    except Exception as exc:
        clean = isinstance(exc, (ValueError, OSError)) and not isinstance(exc, MemoryError)
        result = {"ok": False, "clean": clean, "type": type(exc).__name__, "message": str(exc)}
    print(json.dumps({"name": case["name"], **result}), flush=True)
"""


@dataclass
class Case:
    name: str
    path: Path
    # "error": a clean exception naming the file; "ok": loads; "either": a flip may be harmless.
    expect: str = "error"
    needle: str | None = None  # must appear in the error message
    check: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    kwargs: dict[str, Any] = field(default_factory=dict)  # LLM arguments beyond LOAD_KWARGS


def run_cases(cases: list[Case], tmp_path: Path, timeout: float) -> dict[str, dict[str, Any]]:
    """Load every case in one subprocess; fail on a signal, a timeout or a missing result."""
    spec = tmp_path / "cases.jsonl"
    spec.write_text(
        "".join(
            json.dumps({"name": c.name, "path": str(c.path), "kwargs": LOAD_KWARGS | c.kwargs})
            + "\n"
            for c in cases
        )
    )
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", CHILD, str(ADDRESS_SPACE_LIMIT), str(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        stdout, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, code = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else "", None
    results: dict[str, dict[str, Any]] = {}
    last_started = None
    for line in stdout.splitlines():
        record = json.loads(line)
        if record.get("started"):
            last_started = record["name"]
        else:
            results[record["name"]] = record
    if code is None:
        pytest.fail(f"timed out after {timeout} s while loading case {last_started!r}")
    if code != 0:
        stderr = done.stderr[-2000:]
        pytest.fail(f"exit status {code} while loading case {last_started!r}: {stderr}")
    return results


def assert_clean(cases: list[Case], results: Mapping[str, dict[str, Any]]) -> None:
    problems = []
    for case in cases:
        r = results[case.name]
        if r["ok"]:
            if case.expect == "error":
                problems.append(f"{case.name}: loaded without an error")
            elif case.check is not None:
                case.check(r)
            continue
        message = r["message"]
        if case.expect == "ok":
            problems.append(f"{case.name}: {r['type']}: {message}")
        elif not r["clean"]:
            problems.append(f"{case.name}: unclean {r['type']}: {message}")
        elif case.path.name not in message and case.path.parent.name not in message:
            problems.append(f"{case.name}: the message does not name the file: {message}")
        elif case.needle is not None and case.needle not in message:
            problems.append(f"{case.name}: {case.needle!r} not in: {message}")
    assert not problems, "\n".join(problems)


# ---- building the malformed files ---------------------------------------------------------------
def gguf_with(model_dir: Path, path: Path, **metadata: tuple[Any, Any]) -> Path:
    keys = {f"{{arch}}.{key}": value for key, value in metadata.items()}
    return write_tiny_gguf(model_dir, path, metadata=keys)


def patched(source: Path, path: Path, edit: Callable[[bytearray], None]) -> Path:
    data = bytearray(source.read_bytes())
    edit(data)
    path.write_bytes(bytes(data))
    return path


def truncated(source: Path, path: Path, size: int) -> Path:
    return patched(source, path, lambda data: data.__delitem__(slice(size, None)))


def tensor_info_offsets(path: Path) -> dict[str, int]:
    """Byte offset of each tensor's directory entry (its name length field)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: int(t.field.offset) for t in reader.tensors}


def edit_tensor_info(source: Path, path: Path, tensor: str, what: str, value: int) -> Path:
    """Overwrite one tensor's first dim (`ne0`), type or data offset."""
    start = tensor_info_offsets(source)[tensor]
    raw = source.read_bytes()
    (name_len,) = struct.unpack_from("<Q", raw, start)
    dims_at = start + 8 + name_len + 4
    (ndims,) = struct.unpack_from("<I", raw, dims_at - 4)
    at = {"ne0": (dims_at, "<Q"), "type": (dims_at + 8 * ndims, "<I")}
    at["offset"] = (dims_at + 8 * ndims + 4, "<Q")
    pos, fmt = at[what]
    return patched(source, path, lambda data: struct.pack_into(fmt, data, pos, value))


def nested_arrays(path: Path, depth: int) -> Path:
    """A GGUF whose only metadata value is an array nested `depth` deep."""
    key = b"general.deep"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    body = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    path.write_bytes(head + body)
    return path


def header_count(source: Path, path: Path, which: str, value: int) -> Path:
    """Overwrite the header's tensor count or metadata count."""
    pos = {"tensor_count": 8, "kv_count": 16}[which]
    return patched(source, path, lambda data: struct.pack_into("<Q", data, pos, value))


def flipped(source: Path, path: Path, seed: int, limit: int) -> Path:
    rng = random.Random(seed)

    def edit(data: bytearray) -> None:
        for _ in range(4):
            pos = rng.randrange(4, min(limit, len(data)))
            data[pos] ^= 1 << rng.randrange(8)

    return patched(source, path, edit)


def model_dir_with(source: Path, path: Path, **config: Any) -> Path:
    """A copy of a safetensors model directory with config.json fields replaced."""
    shutil.copytree(source, path)
    data = json.loads((source / "config.json").read_text())
    data.update(config)
    (path / "config.json").write_text(json.dumps(data))
    return path


def model_dir_editing(source: Path, path: Path, edit: Callable[[Path], None]) -> Path:
    shutil.copytree(source, path)
    edit(path)
    return path


def nan_norm(folder: Path) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.0.input_layernorm.weight"][3] = math.nan
    save_file(tensors, str(file))


def rewrite_header(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    (size,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + size])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])


def shift_offsets(header: dict[str, Any]) -> None:
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [10**12, 10**12 + 64]


def loads_short(limit: int) -> Callable[[dict[str, Any]], None]:
    def check(result: dict[str, Any]) -> None:
        assert result["max_model_len"] <= limit, result

    return check


@pytest.fixture(scope="module")
def sources(tiny_models: Mapping[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("malformed_sources")
    llama = tiny_models["llama"]
    return {
        "dir": llama,
        "qwen2": tiny_models["qwen2"],
        "gguf": write_tiny_gguf(llama, root / "f32.gguf"),
        "q8": write_tiny_gguf(llama, root / "q8.gguf", qtype_for=lambda n, a: Q8_0),
    }


def quick_cases(src: dict, tmp: Path) -> list[Case]:
    """One case of each kind the issue found."""
    d, g = src["dir"], src["gguf"]
    return [
        Case("context 2^31", gguf_with(d, tmp / "ctx.gguf", context_length=(2**31, V.UINT32)),
             expect="ok", check=loads_short(1 << 20)),
        Case("explicit context 2^31", tmp / "ctx.gguf", needle="cannot fit",
             kwargs={"max_model_len": 2**31}),
        Case("block_count 10^6", gguf_with(d, tmp / "blocks.gguf", block_count=(10**6, V.UINT32)),
             needle="block_count"),
        Case("0 heads", gguf_with(d, tmp / "heads.gguf", **{"attention.head_count": (0, V.UINT32)}),
             needle="head_count"),
        Case("NaN eps", gguf_with(
            d, tmp / "eps.gguf", **{"attention.layer_norm_rms_epsilon": (math.nan, V.FLOAT32)}),
             needle="layer_norm_rms_epsilon"),
        Case("alignment 0", write_tiny_gguf(d, tmp / "align.gguf",
                                            metadata={"general.alignment": (0, V.UINT32)}),
             needle="general.alignment"),
        Case("nested arrays", nested_arrays(tmp / "deep.gguf", 5000), needle="nests"),
        Case("tensor data cut", truncated(g, tmp / "cut.gguf", g.stat().st_size // 2),
             needle="truncated"),
        Case("layers 10^6", model_dir_with(d, tmp / "layers", num_hidden_layers=10**6),
             needle="num_hidden_layers"),
        # transformers builds Qwen's per-layer `layer_types` list while reading the config.
        Case("qwen2 layers 2^40", model_dir_with(src["qwen2"], tmp / "q2layers",
                                                 num_hidden_layers=2**40),
             needle="num_hidden_layers"),
        Case("vocab 2^40", model_dir_with(d, tmp / "vocab", vocab_size=2**40), needle="vocab_size"),
        Case("NaN norm", model_dir_editing(d, tmp / "nan_norm", nan_norm),
             needle="input_layernorm"),
    ]  # fmt: skip


def test_malformed_files_fail_cleanly(sources: dict, tmp_path: Path) -> None:
    cases = quick_cases(sources, tmp_path)
    assert_clean(cases, run_cases(cases, tmp_path, timeout=120))


def sweep_cases(src: dict, tmp: Path) -> list[Case]:
    d, g, q8 = src["dir"], src["gguf"], src["q8"]
    cases: list[Case] = []
    size = g.stat().st_size
    for cut in (3, 6, 15, 23, 40, 200, 1000, 4000, size // 3, size - 64, size - 1):
        cases.append(Case(f"gguf cut at {cut}", truncated(g, tmp / f"cut{cut}.gguf", cut)))
    for key, value, vtype in [
        ("block_count", 0, V.UINT32),
        ("block_count", 2**32 - 1, V.UINT32),
        ("context_length", 0, V.UINT32),
        ("context_length", math.nan, V.FLOAT32),
        ("embedding_length", 2**40, V.UINT64),
        ("embedding_length", 0, V.UINT32),
        ("feed_forward_length", 2**40, V.UINT64),
        ("vocab_size", 2**40, V.UINT64),
        ("attention.head_count", 2**31, V.UINT32),
        ("attention.head_count_kv", 0, V.UINT32),
        ("attention.head_count_kv", 3, V.UINT32),
        ("attention.key_length", 0, V.UINT32),
        ("attention.key_length", 2**30, V.UINT32),
        ("attention.layer_norm_rms_epsilon", math.inf, V.FLOAT32),
        ("attention.layer_norm_rms_epsilon", -1.0, V.FLOAT32),
        ("rope.freq_base", math.nan, V.FLOAT32),
        ("rope.dimension_count", 2**31, V.UINT32),
        ("block_count", "many", V.STRING),
    ]:
        name = f"{key}={value!r}"
        path = gguf_with(d, tmp / f"meta_{len(cases)}.gguf", **{key: (value, vtype)})
        cases.append(Case(name, path))
    huge = gguf_with(d, tmp / "ctx63.gguf", context_length=(2**63, V.UINT64))
    cases.append(Case("context_length 2^63", huge, expect="ok", check=loads_short(1 << 20)))
    for align in (3, 2**40):
        path = write_tiny_gguf(
            d, tmp / f"align{align}.gguf", metadata={"general.alignment": (align, V.UINT64)}
        )
        cases.append(Case(f"alignment {align}", path))
    tensor = "blk.0.attn_q.weight"
    for what, value in [("ne0", 2**40), ("ne0", 0), ("ne0", 7), ("type", 999), ("type", 19),
                        ("offset", 2**62), ("offset", size)]:  # fmt: skip
        for base in (g, q8):
            out = tmp / f"{what}{value}{base.stem}.gguf"
            path = edit_tensor_info(base, out, tensor, what, value)
            cases.append(Case(f"{base.stem} {tensor} {what}={value}", path))
    for which, value in [("tensor_count", 2**62), ("kv_count", 2**62), ("tensor_count", 0)]:
        path = header_count(g, tmp / f"{which}{value}.gguf", which, value)
        cases.append(Case(f"{which}={value}", path))
    cases.append(Case("nested arrays 3", nested_arrays(tmp / "deep3.gguf", 3)))
    metadata_end = 2000
    for seed in range(40):
        path = flipped(q8 if seed % 2 else g, tmp / f"flip{seed}.gguf", seed, metadata_end)
        cases.append(Case(f"flip {seed}", path, expect="either"))
    for key, value in [
        ("num_hidden_layers", 0), ("hidden_size", 0), ("num_attention_heads", 0),
        ("num_key_value_heads", 3), ("head_dim", 10**9), ("intermediate_size", 2**40),
        ("rms_norm_eps", math.nan), ("max_position_embeddings", -5), ("num_hidden_layers", "2"),
    ]:  # fmt: skip
        path = model_dir_with(d, tmp / f"cfg_{key}_{len(cases)}", **{key: value})
        cases.append(Case(f"config {key}={value!r}", path))
    long_context = model_dir_with(d, tmp / "cfg_ctx", max_position_embeddings=2**31)
    cases.append(Case("config ctx 2^31", long_context, expect="ok", check=loads_short(1 << 20)))

    def config_text(text: str) -> Callable[[Path], None]:
        return lambda folder: (folder / "config.json").write_text(text)

    def weights_bytes(edit: Callable[[bytearray], None]) -> Callable[[Path], None]:
        def apply(folder: Path) -> None:
            file = folder / "model.safetensors"
            data = bytearray(file.read_bytes())
            edit(data)
            file.write_bytes(bytes(data))

        return apply

    for name, edit in [
        ("config []", config_text("[]")),
        ("config cut", config_text('{"architectures": ["LlamaForCausalLM"], ')),
        ("weights cut", weights_bytes(lambda b: b.__delitem__(slice(len(b) // 2, None)))),
        ("weights header size", weights_bytes(lambda b: struct.pack_into("<Q", b, 0, 2**62))),
        ("weights header junk", weights_bytes(lambda b: b.__setitem__(slice(8, 16), b"\xff" * 8))),
        ("weights offsets", lambda f: rewrite_header(f, shift_offsets)),
        ("weights dtype", lambda f: rewrite_header(
            f, lambda h: h["model.norm.weight"].__setitem__("dtype", "Q9"))),
        ("weights shape", lambda f: rewrite_header(
            f, lambda h: h["model.norm.weight"].__setitem__("shape", [2**40]))),
        ("index escapes", lambda f: (f / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "../../etc/passwd"}}))),
    ]:  # fmt: skip
        cases.append(Case(name, model_dir_editing(d, tmp / name.replace(" ", "_"), edit)))
    return cases


@pytest.mark.slow
def test_malformed_file_sweep(sources: dict, tmp_path: Path) -> None:
    cases = sweep_cases(sources, tmp_path)
    results: dict[str, dict[str, Any]] = {}
    for start in range(0, len(cases), 40):
        chunk = cases[start : start + 40]
        results |= run_cases(chunk, tmp_path, timeout=60 + 10 * len(chunk))
    assert_clean(cases, results)


def test_nan_norm_weight_is_refused_in_process(sources: dict, tmp_path: Path) -> None:
    # The cheap check at load: a NaN norm makes every logit NaN (token 0 forever).
    from tinyvllm.config import EngineArgs
    from tinyvllm.engine.setup import build_engine_config
    from tinyvllm.models.loader import load_model

    folder = model_dir_editing(sources["dir"], tmp_path / "nan", nan_norm)
    config = build_engine_config(EngineArgs(model=str(folder), device="cpu")).model
    with pytest.raises(ValueError, match=r"/nan'.*input_layernorm.weight holds NaN"):
        load_model(folder, config.hf_config, torch.float32, "cpu", 64)
