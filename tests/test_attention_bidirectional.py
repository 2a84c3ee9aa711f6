"""Bidirectional spans (multimodal prefixes) in the torch backend, against a dense reference."""

from __future__ import annotations

import pytest
import torch
from attention_cases import make_case, max_error, reference_attention

from tinyvllm.attention.torch_attn import TorchAttentionBackend


def run_torch(case) -> tuple[torch.Tensor, torch.Tensor]:
    backend = TorchAttentionBackend()
    cache = case.kv_cache.clone()
    backend.plan(case.metadata)
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    return out, cache


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "spans", "window"),
    [
        ((12,), (0,), [(3, 9)], None),  # fresh prompt: SDPA fast path must give way
        ((10, 7), (16, 0), [(18, 24), (0, 7)], None),  # span in a later chunk; whole prompt
        ((9, 1), (5, 30), [(5, 14), (2, 20)], None),  # a decode after its span: unaffected
        ((12,), (0,), [(2, 11)], 3),  # later span keys within the window become visible
        ((6,), (4,), [(4, 20)], None),  # span end past seq_len: keys stop at the context
        ((8, 5), (0, 0), [(0, 0), (1, 2)], None),  # empty and one-token spans: plain causal
    ],
)
def test_torch_backend_bidirectional(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    spans: list[tuple[int, int]],
    window: int | None,
) -> None:
    gen = torch.Generator().manual_seed(sum(query_lens) + len(spans))
    case = make_case(
        gen,
        query_lens=query_lens,
        context_lens=context_lens,
        block_size=8,
        sliding_window=window,
        bidirectional=spans,
    )
    out, cache = run_torch(case)
    want = reference_attention(case, cache)
    assert max_error(out, want) < 1e-5
    # The span really changes the result wherever a query in it has a later key in it.
    causal = make_case(
        torch.Generator().manual_seed(sum(query_lens) + len(spans)),
        query_lens=query_lens,
        context_lens=context_lens,
        block_size=8,
        sliding_window=window,
    )
    changed = max_error(run_torch(causal)[0], out) > 1e-3
    md = case.metadata
    effective = any(
        max(s, seq - q) < min(e, seq) - 1
        for (s, e), q, seq in zip(spans, query_lens, md.seq_lens_cpu, strict=True)
    )
    assert changed == effective


def test_torch_backend_bidirectional_with_soft_cap() -> None:
    gen = torch.Generator().manual_seed(7)
    case = make_case(
        gen, query_lens=(11, 1), context_lens=(3, 12), soft_cap=4.0, bidirectional=[(5, 12), (0, 0)]
    )
    out, cache = run_torch(case)
    assert max_error(out, reference_attention(case, cache)) < 1e-5


@pytest.mark.parametrize("window", [None, 3])
def test_torch_backend_several_spans_per_request(window: int | None) -> None:
    """[num_reqs, K, 2] ranges: two images in one chunk, one in a later chunk, none."""
    gen = torch.Generator().manual_seed(3)
    spans = [[(2, 6), (8, 13)], [(20, 25), (0, 0)], [(0, 0), (0, 0)]]
    case = make_case(
        gen, query_lens=(15, 9, 4), context_lens=(0, 18, 5), block_size=8,
        sliding_window=window, bidirectional=spans,
    )  # fmt: skip
    out, cache = run_torch(case)
    assert max_error(out, reference_attention(case, cache)) < 1e-5
    # The second span matters: with the first one alone the result differs.
    alone = make_case(
        torch.Generator().manual_seed(3), query_lens=(15, 9, 4), context_lens=(0, 18, 5),
        block_size=8, sliding_window=window, bidirectional=[[(2, 6)], [(20, 25)], [(0, 0)]],
    )  # fmt: skip
    assert max_error(run_torch(alone)[0], out) > 1e-3
