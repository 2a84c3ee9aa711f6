"""Steps that mix prefill chunks with decode queries on the native CPU attention backend:
the chunks take the torch path, the decode queries the paged decode kernel, and every
token's output matches the reference; prefill steps store K / V with the native row copy."""

from __future__ import annotations

import pytest
import torch
from attention_cases import make_case, max_error, reference_attention

from tinyvllm.attention.cpu_native import NativeCpuAttentionBackend
from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import unsupported_reason

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason="native kernels unavailable"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_mixed_step_decodes_on_the_kernel(
    dtype: torch.dtype, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = NativeCpuOps.load()
    assert ops is not None
    backend = NativeCpuAttentionBackend(ops)
    decoded: list[list[int]] = []
    kernel = ops.paged_decode

    def counted(query, out, token_idx, *args):
        decoded.append(token_idx.tolist())
        return kernel(query, out, token_idx, *args)

    monkeypatch.setattr(ops, "paged_decode", counted)
    gen = torch.Generator().manual_seed(11)
    # A fresh prompt, decodes with short and block-crossing contexts, a chunk with context.
    case = make_case(
        gen,
        query_lens=[1, 7, 1, 1, 12],
        context_lens=[30, 0, 50, 4, 20],
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        sliding_window=window,
    )
    md = case.metadata
    backend.plan(md)
    cache = case.kv_cache.clone()
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, md)
    assert decoded == [[0, 8, 9]]  # the three decode queries, by their token index
    assert torch.equal(cache, case.expected_cache())
    want = reference_attention(case, cache)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert max_error(out, want) < tol

    # Each decode query's output is the kernel's: as in a decode-only step of those rows.
    alone = torch.zeros_like(out)
    idx = torch.tensor([0, 8, 9])
    kernel(case.query, alone, idx, torch.tensor([0, 2, 3]), md.seq_lens, md.block_table,
           cache, case.layer.scale, window, None)  # fmt: skip
    assert torch.equal(out[idx], alone[idx])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_steps_store_kv_with_the_native_row_copy(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch path's index_copy_ of a prefill step's K / V took 2-15 ms a layer at 4,096
    tokens; the backend copies the rows natively, into the same cache bits."""
    ops = NativeCpuOps.load()
    assert ops is not None
    stored: list[int] = []
    copy = ops.store_kv

    def counted(key, value, kv_cache, slots):
        stored.append(key.shape[0])
        return copy(key, value, kv_cache, slots)

    monkeypatch.setattr(ops, "store_kv", counted)
    case = make_case(
        torch.Generator().manual_seed(12),
        query_lens=[9, 20],
        context_lens=[0, 5],
        head_dim=64,
        dtype=dtype,
    )
    backend = NativeCpuAttentionBackend(ops)
    backend.plan(case.metadata)
    cache = case.kv_cache.clone()
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    assert stored == [29]
    assert torch.equal(cache, case.expected_cache())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert max_error(out, reference_attention(case, cache)) < tol
