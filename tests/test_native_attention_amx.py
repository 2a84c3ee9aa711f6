"""The AMX paged decode attention (tinyvllm/native/attn_amx.cpp): where the CPU has AMX, bf16
caches with head_dim 64 and long enough contexts take it, it matches a float64 reference within
the bf16 tolerance of the other kernels (GQA groups of 1 to 16, contexts off the 16-position
chunks, windows that start inside a block, soft-caps, 32-position blocks, several query tokens
of one request), differs from the AVX-512 kernel only by summation order, and other shapes and
short contexts fall back to that kernel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from attention_cases import paged_decode_reference

from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import load_library, unsupported_reason
from tinyvllm.utils.cpu import cpu_flags

MIN_MEAN_POSITIONS = 160  # kMinMeanPositions in attn_amx.cpp
# Contexts off and on the 16-position chunks (1, 15: a partial first chunk; 17: one past),
# long enough on average for the AMX kernel, also under the windows below.
LENS = [1, 15, 16, 17, 100, 450, 700, 900, 1000, 1200]

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None or not cpu_flags() >= {"amx_bf16", "amx_tile", "avx512_bf16"},
    reason="native kernels or AMX-BF16 unavailable",
)


@pytest.fixture()
def lib() -> Iterator:
    loaded = load_library()
    assert loaded is not None
    yield loaded
    loaded.tv_set_decode_amx(1)


def _case(seed: int, hq: int, hkv: int, lens: list[int], block_size: int = 16, d: int = 64):
    gen = torch.Generator().manual_seed(seed)
    rows = len(lens)
    per_row = (max(lens) + block_size - 1) // block_size
    num_blocks = rows * per_row + 3
    kv = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = perm[: rows * per_row].view(rows, per_row).contiguous()
    q = (torch.randn(rows, hq, d, generator=gen) * 0.5).bfloat16()
    return q, kv, torch.tensor(lens, dtype=torch.int32), block_table


def _decode(lib, amx: bool, q, kv, seq_lens, block_table, window, cap) -> torch.Tensor:
    """The op's output with the AMX kernel allowed or not; checks whether it ran."""
    assert lib.tv_set_decode_amx(int(amx)) == int(amx)
    out = torch.zeros_like(q)
    tok = torch.arange(q.shape[0])
    scale = q.shape[-1] ** -0.5
    before = lib.tv_decode_amx_calls()
    ops = NativeCpuOps(lib, 2)
    ops.paged_decode(q, out, tok, tok, seq_lens, block_table, kv, scale, window, cap)
    positions = [min(int(n), window or int(n)) for n in seq_lens]
    fits = q.dtype == torch.bfloat16 and q.shape[-1] == 64
    fits = fits and sum(positions) >= MIN_MEAN_POSITIONS * len(positions)
    assert lib.tv_decode_amx_calls() == before + int(amx and fits)
    return out.float()


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 1), (2, 2), (16, 2), (16, 1), (12, 4)])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (350, None), (333, 30.0), (None, 30.0)])
def test_amx_decode_matches_reference_and_avx512(
    lib, hq: int, hkv: int, window: int | None, cap: float | None
) -> None:
    # Windows of 350 and 333 start inside a block.
    q, kv, seq_lens, block_table = _case(hq * 10 + hkv, hq, hkv, LENS)
    got = _decode(lib, True, q, kv, seq_lens, block_table, window, cap)
    wide = _decode(lib, False, q, kv, seq_lens, block_table, window, cap)
    want = paged_decode_reference(q, kv, seq_lens, block_table, q.shape[-1] ** -0.5, window, cap)
    torch.testing.assert_close(got, want.float(), rtol=1e-2, atol=1e-2)
    # The same fp32 math as the AVX-512 kernel in another summation order: bf16 outputs at
    # most one rounding step apart (mostly equal).
    assert ((got - wide).abs() <= wide.abs() * 2.0**-7 + 1e-6).all()


def test_amx_decode_blocks_of_32_and_tokens_of_one_request(lib) -> None:
    q, kv, _, block_table = _case(7, 9, 3, [270, 270, 270, 205], block_size=32)
    # Three query tokens of request 0 attend causally (268, 269, 270 positions), as verify
    # tokens do: the op passes lengths per token through tok_lens.
    lens = torch.tensor([268, 269, 270, 205], dtype=torch.int32)
    rows = torch.tensor([0, 0, 0, 3])
    tok = torch.arange(4)
    out = torch.zeros_like(q)
    assert lib.tv_set_decode_amx(1) == 1
    before = lib.tv_decode_amx_calls()
    lib.tv_paged_decode(
        q.data_ptr(), q.stride(0), out.data_ptr(), 1, 4, tok.data_ptr(), rows.data_ptr(),
        lens.data_ptr(), None, block_table.data_ptr(), block_table.stride(0), kv.data_ptr(),
        kv.shape[1], 32, 9, 3, 64, 0.125, 0, 0.0, 2,
    )  # fmt: skip
    assert lib.tv_decode_amx_calls() == before + 1
    want = paged_decode_reference(q, kv, lens, block_table[rows], 0.125, None, None)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("d", "dtype", "lens"),
    [(128, torch.bfloat16, LENS), (64, torch.float32, LENS), (64, torch.bfloat16, [300, 17])],
)
def test_other_shapes_and_short_contexts_take_the_avx512_kernel(
    lib, d: int, dtype: torch.dtype, lens: list[int]
) -> None:
    q, kv, seq_lens, block_table = _case(3, 9, 3, lens, d=d)
    q, kv = q.to(dtype), kv.to(dtype)
    got = _decode(lib, True, q, kv, seq_lens, block_table, None, None)
    wide = _decode(lib, False, q, kv, seq_lens, block_table, None, None)
    assert torch.equal(got, wide)
