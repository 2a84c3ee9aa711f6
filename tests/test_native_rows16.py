"""GGUF matrices repacked 16 rows at a time (tinyvllm/native/rows16_layout.cpp): the
int8-activation GEMVs (int8_rows16.cpp, int8_rows16_avx2.cpp) against the torch reference of
their arithmetic (test_native_int8.py), the exact bf16 GEMVs (bf16_rows16.cpp,
bf16_rows16_avx2.cpp, bf16_rows16_avx512f.cpp) against fp32 products and the file layout's
kernel, and the layout's other readers: dequantized rows and embedding lookups give the file
layout's bits. The engine repacks where a GEMV reads the layout. The kernels of the CPU's best
instruction set and the AVX2 ones are each tested."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_native_int8 import FORMATS, check, random_blocks, reference

from tinyvllm.native.abi import (
    FORMAT_INT8_ACT,
    FORMAT_Q4_0,
    FORMAT_Q4_1,
    FORMAT_Q8_0,
    FORMAT_ROWS16,
)
from tinyvllm.native.build import load_library, unsupported_reason
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.utils.cpu import cpu_flags

AVX512_FOUNDATION = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    lib = load_library()
    assert lib is not None
    lib.tv_set_isa(0)
    kernels = QuantKernels(lib, 2)
    assert kernels.rows16_supported(FORMAT_Q4_1)  # AVX512-VNNI or AVX2 kernels
    return kernels


@pytest.fixture(params=["best", "avx2"])
def isa(request: pytest.FixtureRequest, kernels: QuantKernels) -> Iterator[str]:
    """The kernels of the CPU's best instruction set, then the AVX2 ones (the same layout)."""
    kernels.lib.tv_set_isa(0 if request.param == "best" else 1)
    if request.param == "best" and not cpu_flags() >= AVX512_FOUNDATION:
        pytest.skip("AVX2 is this CPU's best: the avx2 case covers it")
    yield request.param
    kernels.lib.tv_set_isa(0)


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: FORMATS[f][0])
@pytest.mark.parametrize("k", [32, 96, 576, 1536])  # odd block counts end on one accumulator
@pytest.mark.parametrize("m", [1, 4, 7, 13])  # tiles of 4 input rows and their remainders
def test_rows16_gemv_matches_the_reference(kernels: QuantKernels, fmt: int, k: int, m: int) -> None:
    gen = torch.Generator().manual_seed(fmt * 1000 + k + m)
    rows = 80  # 5 groups: items of 2 groups and a short last one
    blocks = random_blocks(fmt, rows, k, gen)
    packed = kernels.repack_rows16(fmt, blocks, k)
    assert not torch.equal(packed, blocks)
    code = fmt | FORMAT_INT8_ACT | FORMAT_ROWS16
    x = torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero block: dx = 0
    check(kernels.gemv(x, code, packed, rows), reference(x, fmt, blocks), x, blocks, fmt)
    xb = x.bfloat16()
    got = kernels.gemv(xb, code, packed, rows)
    assert got.dtype == torch.bfloat16
    check(got, reference(xb, fmt, blocks), xb, blocks, fmt)
    bias = torch.randn(rows, generator=gen)
    with_bias = kernels.gemv(x, code, packed, rows, bias)
    check(with_bias, reference(x, fmt, blocks) + bias, x, blocks, fmt)


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: FORMATS[f][0])
def test_rows16_rows_read_back_as_the_file_layout(kernels: QuantKernels, fmt: int) -> None:
    """Dequantized rows (the prefill GEMM's path) and embedding lookups of the repacked
    matrix are bit for bit those of the file's blocks."""
    gen = torch.Generator().manual_seed(fmt)
    rows, k = 48, 96
    blocks = random_blocks(fmt, rows, k, gen)
    packed = kernels.repack_rows16(fmt, blocks, k)
    code = fmt | FORMAT_ROWS16
    want = kernels.dequantize_rows(fmt, blocks, k, 0, rows)
    assert torch.equal(kernels.dequantize_rows(code, packed, k, 0, rows), want)
    assert torch.equal(kernels.dequantize_rows(code, packed, k, 17, 40), want[17:40])
    ids = torch.tensor([[0, 15, 16], [47, 31, 2]])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            kernels.embedding(code, packed, k, ids, dtype),
            kernels.embedding(fmt, blocks, k, ids, dtype),
        )
    # Prefill-sized batches dequantize slabs of the repacked rows for an exact GEMM.
    x = torch.randn(80, k, generator=gen)
    assert torch.equal(
        kernels.linear(x, code | FORMAT_INT8_ACT, packed, rows),
        kernels.linear(x, fmt, blocks, rows),
    )


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("fmt", [FORMAT_Q4_0, FORMAT_Q4_1], ids=["Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [32, 96, 576])
def test_exact_rows16_gemv_is_the_file_kernels_arithmetic(
    kernels: QuantKernels, fmt: int, k: int
) -> None:
    """bf16 activations: every product exact, fp32 sums (within their rounding of the
    dequantized fp32 product), each row's bits independent of the batch around it, and the
    file layout's kernel's bits on nearly every output (only the summation order differs)."""
    assert kernels.rows16_exact_supported(fmt)  # AVX512-BF16 or AVX2 kernels
    gen = torch.Generator().manual_seed(fmt * 100 + k)
    rows = 80
    blocks = random_blocks(fmt, rows, k, gen)
    packed = kernels.repack_rows16(fmt, blocks, k)
    dense = kernels.dequantize_rows(fmt, blocks, k, 0, rows)
    bias = torch.randn(rows, generator=gen).bfloat16()
    x = torch.randn(64, k, generator=gen).bfloat16()
    alone = torch.cat([kernels.gemv(x[i : i + 1], fmt | FORMAT_ROWS16, packed, rows, bias)
                       for i in range(len(x))])  # fmt: skip
    for m in (1, 2, 3, 4, 5, 9, 13, 64):
        got = kernels.gemv(x[:m], fmt | FORMAT_ROWS16, packed, rows, bias)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, alone[:m]), m
        want = torch.nn.functional.linear(x[:m].float(), dense, bias.float())
        bound = 1e-5 * (x[:m].float().abs() @ dense.abs().t()) + 1e-6 + want.abs() * 2.0**-8
        assert ((got.float() - want).abs() - bound).max() <= 0, m
    same = torch.eq(alone, kernels.gemv(x, fmt, blocks, rows, bias)).float().mean()
    assert same > 0.95, same
    # fp32 activations (the engine never pairs them with the layout): the file's kernel.
    xf = torch.randn(3, k, generator=gen)
    assert torch.equal(kernels.gemv(xf, fmt | FORMAT_ROWS16, packed, rows),
                       kernels.gemv(xf, fmt, blocks, rows))  # fmt: skip


@pytest.mark.skipif(
    not cpu_flags() >= AVX512_FOUNDATION or "avx512_bf16" in cpu_flags(),
    reason="the AVX-512 Foundation kernel runs on AVX-512 CPUs without BF16",
)
@pytest.mark.parametrize("fmt", [FORMAT_Q4_0, FORMAT_Q4_1], ids=["Q4_0", "Q4_1"])
def test_exact_rows16_on_avx512_foundation_is_the_avx2_kernels_bits(
    kernels: QuantKernels, fmt: int
) -> None:
    """bf16_rows16_avx512f.cpp: one register per group of 16 rows, each lane running the
    AVX2 kernel's operations in the same order, so the same bits."""
    gen = torch.Generator().manual_seed(fmt + 7)
    rows, k = 96, 1536
    packed = kernels.repack_rows16(fmt, random_blocks(fmt, rows, k, gen), k)
    bias = torch.randn(rows, generator=gen).bfloat16()
    x = torch.randn(9, k, generator=gen).bfloat16()
    got = {}
    try:
        for level in (1, 0):
            kernels.lib.tv_set_isa(level)
            got[level] = kernels.gemv(x, fmt | FORMAT_ROWS16, packed, rows, bias)
    finally:
        kernels.lib.tv_set_isa(0)
    assert torch.equal(got[0], got[1])


def test_repack_refuses_a_partial_group(kernels: QuantKernels) -> None:
    blocks = random_blocks(FORMAT_Q4_1, 40, 64, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        kernels.repack_rows16(FORMAT_Q4_1, blocks, 64)


def test_engine_repacks_only_with_int8_activations(
    tiny_models: object, tmp_path: Path, kernels: QuantKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The opt-in stores the 16-row layout (the embedding too) and stays as close to the exact
    default as the file layout's int8 kernels; the default keeps the file's blocks."""
    from test_native_int8 import PROMPT, _prompt_logprobs, tiny_q4_1_gguf

    from tinyvllm import LLM

    path, prompt = tiny_q4_1_gguf(tiny_models, tmp_path), PROMPT
    got = {}
    for layout in ("file, exact", "file, int8", "rows16, int8"):
        int8 = layout.endswith("int8")
        with monkeypatch.context() as patch:
            if layout == "file, int8":
                patch.setattr(QuantKernels, "rows16_supported", lambda self, fmt: False)
            llm = LLM(str(path), dtype="float32", max_model_len=128, int8_activations=int8)
        model = llm.engine.runner.model.model
        for name, packed in (("mlp", model.layers[0].mlp.gate_up_proj.qweight.packed),
                             ("embed", model.embed_tokens.qweight.packed)):  # fmt: skip
            assert bool(packed.code & FORMAT_ROWS16) == layout.startswith("rows16")
            dense = packed.dequantize(torch.float32)  # the same matrix in every layout
            assert torch.equal(dense, got.setdefault(name, dense))
        got[layout] = _prompt_logprobs(llm, prompt)
    # Not the file layout's int8 values: a rounding of an activation to int8 flips with the
    # last bit of its input, so fp32 sums in another order move later layers by as much as
    # int8 does. Both stay as close to the exact default as test_native_int8 asks.
    exact = got["file, exact"]
    scale = sum(abs(v) for v in exact) / len(exact)
    int8_layouts = ["rows16, int8"]
    if kernels.int8_activations_supported(FORMAT_Q4_1):
        int8_layouts.append("file, int8")
    else:  # AVX2: the file layout's int8 flag falls back to the exact kernels
        assert got["file, int8"] == exact
    for layout in int8_layouts:
        diffs = [abs(a - b) for a, b in zip(exact, got[layout], strict=True)]
        assert 0 < sum(diffs) / len(diffs) < 0.03 * scale, (layout, diffs, scale)
        assert max(diffs) < 0.1 * scale, (layout, diffs, scale)


def test_engine_repacks_for_the_exact_gemv_in_bf16_only(
    tiny_models: object, tmp_path: Path, kernels: QuantKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default (exact) path stores Q4_1 layers in the 16-row layout for a bf16 model,
    keeps Q8_0 (no exact kernel reads it) and fp32 models' weights in the file's layout, and
    computes what the file layout computes up to summation order."""
    from test_native_int8 import PROMPT, _prompt_logprobs, tiny_q4_1_gguf

    from tinyvllm import LLM

    assert kernels.rows16_exact_supported(FORMAT_Q4_1)
    path, prompt = tiny_q4_1_gguf(tiny_models, tmp_path), PROMPT
    got = {}
    for dtype, rows16 in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        with monkeypatch.context() as patch:
            if not rows16:
                patch.setattr(QuantKernels, "rows16_exact_supported", lambda self, fmt: False)
            llm = LLM(str(path), dtype=dtype, max_model_len=128)
        model = llm.engine.runner.model.model
        layer = model.layers[0].mlp.gate_up_proj.qweight.packed
        assert bool(layer.code & FORMAT_ROWS16) == rows16
        assert model.embed_tokens.qweight.packed.code == FORMAT_Q8_0
        got[dtype, rows16] = _prompt_logprobs(llm, prompt)
    diffs = [abs(a - b) for a, b in zip(got["bfloat16", True], got["bfloat16", False], strict=True)]
    # bf16 activations round after every layer, so another summation order moves a logprob
    # by about what bf16 itself moves it from fp32.
    bf16_vs_fp32 = [abs(a - b) for a, b in
                    zip(got["bfloat16", False], got["float32", False], strict=True)]  # fmt: skip
    assert sum(diffs) <= 2 * sum(bf16_vs_fp32) + 1e-3, (diffs, bf16_vs_fp32)
