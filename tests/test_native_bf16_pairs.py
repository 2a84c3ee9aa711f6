"""bf16 weights in the pair layout (tinyvllm/native/bf16_pairs.cpp): the repacking puts each
weight where the layout says, the GEMM on it agrees with fp32 matmul within rounding, gives a
row the same bits whatever the batch, tiling, threads or instruction set, and the decode
program takes the layout at its first batch of requests, within the weight-copy budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_native_decode import _near_tie_divergence, _prompts, _run

from tinyvllm import LLM
from tinyvllm.native.abi import FORMAT_BF16, FORMAT_ROWS16
from tinyvllm.native.build import load_library, unsupported_reason
from tinyvllm.native.llama_decode import MAX_PAIRS_ROWS
from tinyvllm.native.ops import NativeCpuOps, max_linear_rows
from tinyvllm.native.pair_copies import LINEARS
from tinyvllm.native.quant_ops import QuantKernels

PAIRS = FORMAT_BF16 | FORMAT_ROWS16
AVX2 = 1
pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


def _repack(lib, w: torch.Tensor) -> torch.Tensor:
    """The layout whatever this CPU's kernels prefer (NativeCpuOps.bf16_pairs asks that)."""
    out = torch.empty_like(w)
    lib.tv_repack_bf16_pairs(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr(), 2)
    return out


def _gemm(lib, x: torch.Tensor, packed: torch.Tensor, bias=None, threads: int = 2):
    return QuantKernels(lib, threads).gemv(x, PAIRS, packed, packed.shape[0], bias)


def test_repacking_puts_weights_k_and_k_plus_1_of_16_rows_in_one_vector(lib) -> None:
    n, k = 32, 6
    w = torch.arange(n * k, dtype=torch.int32).reshape(n, k).to(torch.int16)
    packed = _repack(lib, w.view(torch.bfloat16)).view(torch.int16)
    # [group][pair][row in group][k even / odd]
    want = w.view(2, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n, k)
    assert torch.equal(packed, want)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_pair_gemm_matches_fp32_within_rounding(lib, x_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    # One 16-row group, a whole item and a half one, K from one pair to past a 256-pair block.
    for n, k in ((16, 2), (48, 64), (96, 576), (64, 1538)):
        w = torch.randn(n, k, generator=gen).bfloat16()
        b = torch.randn(n, generator=gen).to(x_dtype)
        x = torch.randn(27, k, generator=gen).to(x_dtype)
        got = _gemm(lib, x, _repack(lib, w), b)
        assert got.dtype == x_dtype
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        bound = 1e-5 * (x.float().abs() @ w.float().abs().t()) + 1e-6
        if x_dtype == torch.bfloat16:
            bound = bound + want.abs() * 2.0**-8  # the output's own rounding
        assert ((got.float() - want).abs() <= bound).all(), (n, k)


def test_pair_gemm_row_bits_ignore_batch_tiles_threads_and_vectors(lib) -> None:
    """Each output is one FMA chain over k in order, so 1 row alone, 40 rows in 4 tiles, 1 or
    3 threads, and the AVX2 kernel (ISA forced down; the AVX-512 one where the CPU has it)
    give the same bits."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(80, 600, generator=gen).bfloat16()
    x = torch.randn(40, 600, generator=gen)
    packed = _repack(lib, w)
    batched = _gemm(lib, x, packed)
    alone = torch.cat([_gemm(lib, x[i : i + 1], packed, threads=1) for i in range(40)])
    assert torch.equal(batched, alone)
    assert torch.equal(_gemm(lib, x[:13], packed, threads=3), batched[:13])
    lib.tv_set_isa(AVX2)
    assert torch.equal(_gemm(lib, x[:5], packed), batched[:5])
    assert torch.equal(_gemm(lib, x, packed), batched)


def test_ops_repack_only_where_the_kernel_and_shape_fit(lib) -> None:
    ops = NativeCpuOps(lib, 2)
    fits = bool(lib.tv_bf16_pairs_supported())
    assert (ops.bf16_pairs(torch.zeros(32, 8, dtype=torch.bfloat16)) is not None) == fits
    assert ops.bf16_pairs(torch.zeros(24, 8, dtype=torch.bfloat16)) is None  # 24 % 16
    assert ops.bf16_pairs(torch.zeros(32, 7, dtype=torch.bfloat16)) is None  # odd K
    assert ops.bf16_pairs(torch.zeros(32, 8)) is None  # fp32 weights


def _linear_codes(llm: LLM) -> set[int]:
    program = llm.engine.runner.decode_program
    assert program is not None
    return {
        code
        for layer in program._layers
        for code in (layer.qkv_fmt, layer.o_fmt, layer.gate_up_fmt, layer.down_fmt)
    }


def _pair_bytes(llm: LLM) -> int:
    plan = llm.engine.runner.model.native_decode_plan()
    return sum(getattr(layer, name).data.nbytes for layer in plan.layers for name in LINEARS)


@pytest.mark.usefixtures("one_torch_thread")
def test_decode_program_takes_pair_copies_at_a_batch_within_the_budget(tiny_models) -> None:
    path: Path = tiny_models["llama"]
    kw = {"dtype": "bfloat16", "max_model_len": 256}
    if not load_library().tv_bf16_pairs_supported():
        assert _linear_codes(LLM(str(path), **kw)) == {FORMAT_BF16}
        pytest.skip("CPU whose best kernels do not read the pair layout")
    paired = LLM(str(path), **kw)
    budget = paired.engine.runner.platform.fp32_copy_budget
    fp32_most = budget.reserved
    assert fp32_most > 0 and budget.spent == 0
    vocab = paired.engine.config.model.vocab_size
    # One sequence (a 20-token prompt step, then single rows) makes no copy.
    _run(paired, [{"prompt_token_ids": list(range(5, 25))}], max_tokens=3)
    assert _linear_codes(paired) == {FORMAT_BF16} and budget.spent == 0
    assert paired.engine.runner.decode_program.max_rows == max_linear_rows(torch.bfloat16)
    prompts = _prompts(vocab, seed=1) + _prompts(vocab, seed=4)  # 10 rows: one pair tile
    eager = LLM(str(path), enforce_eager=True, **kw)
    ref = _run(eager, prompts)
    _near_tie_divergence(ref, _run(paired, prompts), margin=0.1)
    assert _linear_codes(paired) == {PAIRS}
    assert paired.engine.runner.decode_program.max_rows == MAX_PAIRS_ROWS
    # The layers' fp32 GEMM copies come first: a budget they may use up leaves the program
    # none, one for both gives both.
    rows = LLM(str(path), fp32_weight_copy_bytes=fp32_most, **kw)
    _near_tie_divergence(ref, _run(rows, prompts), margin=0.1)
    assert _linear_codes(rows) == {FORMAT_BF16}
    assert rows.engine.runner.decode_program.max_rows == max_linear_rows(torch.bfloat16)
    both = LLM(str(path), fp32_weight_copy_bytes=fp32_most + _pair_bytes(paired), **kw)
    _run(both, prompts, max_tokens=2)
    assert _linear_codes(both) == {PAIRS}
    # 5 prompts, 103 tokens: the first step is one program call past max_linear_rows.
    short = _prompts(vocab, seed=2)
    assert 64 < sum(len(p["prompt_token_ids"]) for p in short) <= MAX_PAIRS_ROWS
    program = paired.engine.runner.decode_program
    steps: list[int] = []
    run = program.run
    program.run = lambda input_ids, *a, **k: (
        steps.append(input_ids.shape[0]) or run(input_ids, *a, **k)
    )
    _near_tie_divergence(_run(eager, short), _run(paired, short), margin=0.1)
    assert steps[0] == sum(len(p["prompt_token_ids"]) for p in short)
