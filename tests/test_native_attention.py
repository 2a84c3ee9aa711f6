"""The AVX-512 paged decode attention (tinyvllm/native/attn_avx512.cpp) agrees with the AVX2
kernel and a torch reference on GQA groups, head sizes, windows, soft-caps and contexts that
cross block boundaries."""

from __future__ import annotations

import pytest
import torch
from attention_cases import paged_decode_reference

from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import unsupported_reason
from tinyvllm.utils.cpu import cpu_flags

AVX2, BEST = 1, 0  # tv_set_isa: AVX2 only, or the best this CPU has
# The kernel needs no BF16 instruction: AVX-512 Foundation CPUs (Skylake-SP to Ice Lake) run it.
WIDE_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
pytestmark = [
    pytest.mark.skipif(unsupported_reason() is not None, reason="native kernels unavailable"),
    pytest.mark.skipif(not cpu_flags() >= WIDE_FLAGS, reason="CPU without AVX-512"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,d", [(1, 64), (3, 64), (8, 128), (3, 256), (16, 32), (9, 48)])
@pytest.mark.parametrize("window,cap", [(None, None), (21, None), (None, 30.0)])
def test_avx512_paged_decode_matches_avx2_and_torch(
    lib, dtype: torch.dtype, group: int, d: int, window: int | None, cap: float | None
) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + d)
    block_size, hkv, rows = 16, 2, 5
    seq_lens = torch.tensor([1, 15, 16, 17, 83], dtype=torch.int32)  # block edges, a tail
    blocks_per_row = 6
    num_blocks = rows * blocks_per_row + 3
    kv = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = perm[: rows * blocks_per_row].view(rows, blocks_per_row).contiguous()
    q = (torch.randn(rows, hkv * group, d, generator=gen) * 0.5).to(dtype)
    scale = d**-0.5
    tok = torch.arange(rows)
    got = {}
    for isa in (AVX2, BEST):
        lib.tv_set_isa(isa)
        out = torch.zeros_like(q)
        NativeCpuOps(lib, 2).paged_decode(
            q, out, tok, tok, seq_lens, block_table, kv, scale, window, cap
        )
        got[isa] = out.float()
    want = paged_decode_reference(q, kv, seq_lens, block_table, scale, window, cap).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for isa in (AVX2, BEST):
        torch.testing.assert_close(got[isa], want, rtol=tol, atol=tol, msg=f"isa {isa}")
    # Same fp32 math in another summation order: the two kernels agree to fp32 rounding.
    torch.testing.assert_close(got[BEST], got[AVX2], rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert (got[BEST] - got[AVX2]).abs().max() < 2e-6
        assert not torch.equal(got[BEST], got[AVX2])  # the wide kernel did run
