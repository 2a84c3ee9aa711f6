"""Triton attention kernels on CUDA: against the dense reference and the torch backend in
bf16/fp16 over larger random batches, split-KV, padding, no host syncs, CUDA-graph replay."""

from __future__ import annotations

import random

import pytest
import torch
from attention_cases import Case, make_case, max_error, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# |out| is O(1); bf16 probabilities carry ~3 significant digits into P @ V.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
HEADS = ((16, 8), (32, 4), (8, 1), (12, 12), (28, 4))


def run_backend(name: str, case: Case, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "triton":
        from tinyvllm.attention.triton_attn import TritonAttentionBackend

        backend = TritonAttentionBackend(**kwargs)
    else:
        from tinyvllm.attention.torch_attn import TorchAttentionBackend

        backend = TorchAttentionBackend()
    cache = case.kv_cache.clone()
    backend.plan(case.metadata)
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    torch.cuda.synchronize()
    return out, cache


def random_case(rng: random.Random, dtype: torch.dtype, **overrides) -> Case:
    num_reqs = rng.randint(1, 24)
    heads, kv_heads = rng.choice(HEADS)
    kwargs = dict(
        query_lens=[rng.choice((1, 1, 1, rng.randint(2, 300))) for _ in range(num_reqs)],
        context_lens=[rng.choice((0, rng.randint(1, 3000))) for _ in range(num_reqs)],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=rng.choice((64, 128, 128, 96)),
        block_size=rng.choice((16, 16, 32)),
        dtype=dtype,
        device="cuda",
        sliding_window=rng.choice((None, None, rng.randint(16, 1024))),
        soft_cap=rng.choice((None, None, 30.0)),
    )
    kwargs.update(overrides)
    return make_case(torch.Generator().manual_seed(rng.randrange(1 << 30)), **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_batches_match_reference_and_torch(dtype: torch.dtype) -> None:
    rng = random.Random(17)
    for _ in range(12):
        case = random_case(rng, dtype)
        out, cache = run_backend("triton", case)
        assert torch.equal(cache, case.expected_cache())
        n = case.num_real_tokens
        assert max_error(out[:n], reference_attention(case, cache)) < TOLERANCE[dtype]
        want, _ = run_backend("torch", case)
        assert max_error(out[:n], want[:n]) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits", [None, 1, 4, 16])
def test_long_context_decode_split_kv(num_splits: int | None) -> None:
    """Few long sequences: the heuristic picks flash decoding (None); forced factors agree."""
    gen = torch.Generator().manual_seed(0)
    case = make_case(
        gen,
        query_lens=(1, 1, 4),
        context_lens=(8000, 37, 5000),
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        pad_reqs=2,
        pad_tokens=5,
    )
    out, cache = run_backend("triton", case, num_splits=num_splits)
    n = case.num_real_tokens
    assert max_error(out[:n], reference_attention(case, cache)) < TOLERANCE[torch.bfloat16]
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_bidirectional_ranges_on_gpu() -> None:
    rng = random.Random(3)
    case = random_case(
        rng,
        torch.bfloat16,
        query_lens=(300, 64, 1, 200),
        context_lens=(0, 700, 900, 10),
        bidirectional=[(20, 280), (710, 760), (5, 600), (0, 0)],
    )
    out, cache = run_backend("triton", case)
    n = case.num_real_tokens
    assert max_error(out[:n], reference_attention(case, cache)) < TOLERANCE[torch.bfloat16]


def test_forward_does_not_sync() -> None:
    from tinyvllm.attention.triton_attn import TritonAttentionBackend

    case = random_case(random.Random(5), torch.bfloat16, pad_reqs=2, pad_tokens=7)
    backend = TritonAttentionBackend()
    cache = case.kv_cache.clone()
    backend.plan(case.metadata)
    # Warm up first: Triton's first launch compiles (and may sync while loading the module).
    backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replay_with_new_metadata() -> None:
    """Capture once with bucket maxima; replay with other requests written into the same
    buffers (fewer real requests and tokens, padding after them): matches eager."""
    from tinyvllm.attention.triton_attn import TritonAttentionBackend

    rng = random.Random(9)
    shape = dict(
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        sliding_window=None,
        soft_cap=None,
    )
    first = random_case(rng, torch.bfloat16, query_lens=(1,) * 8, context_lens=(500,) * 8, **shape)
    second = random_case(
        rng,
        torch.bfloat16,
        query_lens=(1,) * 5,
        context_lens=(3, 900, 40, 1200, 0),
        pad_reqs=3,
        pad_tokens=3,
        spare_blocks=300,
        **shape,
    )
    # Static buffers sized for the bucket: 8 requests x 8 tokens max, 2048-token contexts.
    md = first.metadata
    md.max_query_len, md.max_seq_len = 8, 2048
    width = 2048 // 16
    static_table = torch.zeros(8, width, dtype=torch.int32, device="cuda")
    static_table[:, : md.block_table.shape[1]] = md.block_table
    md.block_table = static_table
    cache = torch.zeros_like(second.kv_cache)
    cache[:, : first.kv_cache.shape[1]] = first.kv_cache
    q, k, v = first.query.clone(), first.key.clone(), first.value.clone()
    backend = TritonAttentionBackend()
    backend.forward(first.layer, q, k, v, cache.clone(), md)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(first.layer, q, k, v, cache, md)

    new = second.metadata
    md.query_start_loc.copy_(new.query_start_loc)
    md.seq_lens.copy_(new.seq_lens)
    md.slot_mapping.copy_(new.slot_mapping)
    md.block_table.zero_()
    md.block_table[:, : new.block_table.shape[1]] = new.block_table
    q.copy_(second.query)
    k.copy_(second.key)
    v.copy_(second.value)
    cache.copy_(second.kv_cache)
    graph.replay()
    torch.cuda.synchronize()
    n = second.num_real_tokens
    assert torch.equal(cache, second.expected_cache())
    want = reference_attention(second, cache)
    assert max_error(out[:n], want) < TOLERANCE[torch.bfloat16]
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
