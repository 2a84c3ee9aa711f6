"""The torch backend's prefill runs SDPA on batched (4-D) operands, the shape CPU torch fuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from attention_cases import make_case, max_error, reference_attention

from tinyvllm.attention.torch_attn import TorchAttentionBackend
from tinyvllm.native.ops import MAX_LINEAR_ROWS


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


@pytest.mark.parametrize("native_bf16", [True, False])
def test_bf16_prefill_sdpa_runs_in_bf16_where_the_cpu_has_bf16_matmul(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    # With AVX512-BF16 / AMX a 512-token prefill's SDPA took 2.6 ms in fp32 and 0.9 ms in bf16;
    # without them bf16 is emulated and fp32 wins. Decode queries (here the second request)
    # stay fp32, the precision of the native decode kernels, and so do steps of up to
    # MAX_LINEAR_ROWS tokens, which the native decode program takes where it runs.
    import tinyvllm.attention.torch_attn as torch_attn

    monkeypatch.setattr(torch_attn, "has_native_bf16_matmul", lambda: native_bf16)
    dtypes: list[tuple[int, torch.dtype]] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        dtypes.append((q.shape[2], q.dtype))  # (query length, dtype)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    # The decode query counts towards the step: MAX_LINEAR_ROWS - 1 + 1 tokens stay fp32.
    for prompt_len, bf16_prefill in ((MAX_LINEAR_ROWS - 1, False), (MAX_LINEAR_ROWS, native_bf16)):
        dtypes.clear()
        case = make_case(
            torch.Generator().manual_seed(6),
            query_lens=(prompt_len, 1),
            context_lens=(0, 9),
            block_size=8,
            dtype=torch.bfloat16,
        )
        backend = TorchAttentionBackend()
        cache = case.kv_cache.clone()
        backend.plan(case.metadata)
        out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
        prefill = torch.bfloat16 if bf16_prefill else torch.float32
        assert sorted(dtypes, key=lambda d: d[0]) == [(1, torch.float32), (prompt_len, prefill)]
        assert max_error(out, reference_attention(case, cache)) < 2e-2
