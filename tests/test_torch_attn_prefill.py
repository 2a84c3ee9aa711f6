"""The torch backend's prefill runs SDPA on batched (4-D) operands, the shape CPU torch fuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from attention_cases import make_case, max_error, reference_attention

from tinyvllm.attention.torch_attn import TorchAttentionBackend


@pytest.mark.parametrize(
    ("context_lens", "window", "spans"),
    [
        ((0,), None, None),  # a fresh prompt: the causal fast path
        ((20,), None, None),  # a later chunk: the explicit mask
        ((0,), 5, None),  # sliding window
        ((0,), None, [(3, 9)]),  # a bidirectional span
    ],
)
def test_prefill_sdpa_gets_batched_operands(
    monkeypatch: pytest.MonkeyPatch,
    context_lens: tuple[int, ...],
    window: int | None,
    spans: list[tuple[int, int]] | None,
) -> None:
    # On CPU, 3-D [heads, L, D] operands take SDPA's unfused math fallback: a 2k-token prefill
    # of a 3B model ran 25x slower per layer than with the batch dimension (flash kernel).
    ranks: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ranks.append(q.dim())
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    case = make_case(
        torch.Generator().manual_seed(5),
        query_lens=(16,),
        context_lens=context_lens,
        block_size=8,
        sliding_window=window,
        bidirectional=spans,
    )
    backend = TorchAttentionBackend()
    cache = case.kv_cache.clone()
    backend.plan(case.metadata)
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    assert ranks and set(ranks) == {4}
    assert max_error(out, reference_attention(case, cache)) < 1e-5
