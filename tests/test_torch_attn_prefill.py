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


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "window", "calls"),
    [
        # 3 x 40 tokens: past MAX_LINEAR_ROWS, so bf16 runs the bf16 prefill SDPA
        ((40, 40, 40), (0, 0, 0), None, 1),  # equal fresh prompts: one batched call
        ((40, 40, 40), (0, 0, 0), 40, 1),  # a window no shorter than the prompts is causal
        ((40, 40, 40), (0, 0, 0), 39, 3),  # a shorter window needs its mask per request
        ((40, 39, 40), (0, 0, 0), None, 3),  # unequal lengths
        ((40, 40), (0, 4), None, 2),  # cached context
        ((12, 12), (0, 0), None, 1),  # a short (fp32) step
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_fresh_prompts_attend_in_one_call_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    window: int | None,
    calls: int,
    dtype: torch.dtype,
) -> None:
    # 8 x 512-token prompts took 8 SDPA calls per layer plus a copy of each output into the
    # step's buffer; one call over [8, H, 512, D] parallelises over the batch and its output
    # is already in the rows' layout. The result must not change: bitwise per request.
    import tinyvllm.attention.torch_attn as torch_attn

    count = [0]
    sdpa = F.scaled_dot_product_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        count[0] += 1
        return sdpa(*args, **kwargs)

    def run(batched: bool) -> torch.Tensor:
        case = make_case(
            torch.Generator().manual_seed(8),
            query_lens=query_lens,
            context_lens=context_lens,
            block_size=8,
            sliding_window=window,
            dtype=dtype,
        )
        backend = TorchAttentionBackend()
        cache = case.kv_cache.clone()
        backend.plan(case.metadata)
        if not batched:
            case.metadata.plan.uniform_len = None
        out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert max_error(out, reference_attention(case, cache)) < tolerance
        return out

    monkeypatch.setattr(torch_attn, "has_native_bf16_matmul", lambda: True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    per_request = run(batched=False)
    count[0] = 0
    assert torch.equal(run(batched=True), per_request)
    assert count[0] == calls
