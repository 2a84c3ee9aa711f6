"""The Triton attention kernels, run by Triton's CPU interpreter, against a dense reference and
the torch backend; plus the backend choice. (tests/test_triton_compile.py compiles them for
sm_90 without a GPU.)

Triton picks the interpreter when it is imported and when a kernel is decorated, so the kernel
tests run in a child pytest process started with TRITON_INTERPRET=1 (`test_in_interpreter`);
in this process they skip. The interpreter's bf16 arithmetic is wrong, so the backend computes
bf16 in fp32 off-GPU and only the final stores round (the interpreter truncates: 1 ulp
allowed). Grids are kept small: each program instance costs ~0.5 ms in the interpreter.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from attention_cases import Case, make_case, max_error, reference_attention

from tinyvllm.attention.backend import get_attention_backend
from tinyvllm.attention.torch_attn import TorchAttentionBackend

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_in_interpreter"
)


def test_in_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("already in the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    result = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.fixture(scope="module")
def triton_attn() -> ModuleType:
    from tinyvllm.attention import triton_attn

    return triton_attn


TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        # fp32 math, then one bf16 rounding (truncating in the interpreter): 1 ulp.
        got, want = got.double(), want.double()
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        excess = (got - want).abs() - (ulp + 1e-5)
        assert excess.max().item() <= 0, f"bf16 error beyond 1 ulp: {excess.max().item()}"
    else:
        assert max_error(got, want) < TOLERANCE[dtype]


def run_triton(triton_attn: ModuleType, case: Case, num_splits: int | None = None):
    backend = triton_attn.TritonAttentionBackend(num_splits=num_splits)
    cache = case.kv_cache.clone()
    backend.plan(case.metadata)
    out = backend.forward(case.layer, case.query, case.key, case.value, cache, case.metadata)
    return out, cache


def check(triton_attn: ModuleType, case: Case, num_splits: int | None = None) -> torch.Tensor:
    """Cache store exact, real rows match the reference, padded rows finite; returns out."""
    dtype = case.query.dtype
    out, cache = run_triton(triton_attn, case, num_splits)
    assert torch.equal(cache, case.expected_cache())
    n = case.num_real_tokens
    assert_close(out[:n], reference_attention(case, cache), dtype)
    assert torch.isfinite(out).all()
    return out


# (num_heads, num_kv_heads): MQA, GQA 2 / 3 / 4, plain MHA.
HEADS = ((4, 1), (4, 2), (6, 2), (8, 2), (2, 2))


def random_case(rng: random.Random, dtype: torch.dtype) -> Case:
    num_reqs = rng.randint(1, 4)
    query_lens = [rng.choice((1, 1, rng.randint(2, 20))) for _ in range(num_reqs)]
    context_lens = [rng.choice((0, rng.randint(1, 70))) for _ in range(num_reqs)]
    heads, kv_heads = rng.choice(HEADS)
    return make_case(
        torch.Generator().manual_seed(rng.randrange(1 << 30)),
        query_lens=query_lens,
        context_lens=context_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=rng.choice((16, 32, 24)),
        block_size=rng.choice((8, 16, 32)),
        dtype=dtype,
        sliding_window=rng.choice((None, None, rng.randint(1, 40))),
        soft_cap=rng.choice((None, None, 5.0)),
    )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_batches_match_reference_and_torch(triton_attn: ModuleType, dtype) -> None:
    rng = random.Random(1234 + len(str(dtype)))
    torch_backend = TorchAttentionBackend()
    for _ in range(5):
        case = random_case(rng, dtype)
        out = check(triton_attn, case)
        cache = case.kv_cache.clone()
        torch_backend.plan(case.metadata)
        want = torch_backend.forward(
            case.layer, case.query, case.key, case.value, cache, case.metadata
        )
        assert_close(out, want.float(), dtype)


@interpreted
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256, 4 query heads on 1 KV: Gemma 3 270M
def test_large_head_dim_and_long_context(triton_attn: ModuleType, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    case = make_case(
        gen,
        query_lens=(1, 17, 3),
        context_lens=(150, 40, 0),
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=16,
        sliding_window=64,
    )
    check(triton_attn, case)


@interpreted
def test_store_casts_to_the_cache_dtype(triton_attn: ModuleType) -> None:
    from tinyvllm.attention.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(2, 6, 3, 24, generator=gen)  # fp32, 3 KV heads (padded to 4)
    cache = torch.zeros(2, 4, 8, 3, 24, dtype=torch.float16)
    slots = torch.tensor([5, -1, 31, 0, -1, 17])
    store_kv(key, value, cache[0], cache[1], slots)
    want = torch.zeros_like(cache)
    keep = slots >= 0
    want[0].view(-1, 3, 24)[slots[keep]] = key[keep].half()
    want[1].view(-1, 3, 24)[slots[keep]] = value[keep].half()
    assert torch.equal(cache, want)


@interpreted
def test_padding_requests_and_tokens(triton_attn: ModuleType) -> None:
    """Graph-replay padding: slot -1 tokens after the real ones and empty requests."""
    gen = torch.Generator().manual_seed(3)
    case = make_case(gen, query_lens=(1, 9, 1), context_lens=(20, 4, 0), pad_reqs=3, pad_tokens=13)
    out = check(triton_attn, case)
    assert torch.equal(out[case.num_real_tokens :], torch.zeros_like(out[case.num_real_tokens :]))
    # max_query_len / max_seq_len are upper bounds (a capture bucket's), not exact values.
    case.metadata.max_query_len, case.metadata.max_seq_len = 32, 512
    assert torch.equal(run_triton(triton_attn, case)[0], out)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 8])
def test_split_kv_matches_reference(triton_attn: ModuleType, dtype, num_splits: int) -> None:
    """Flash decoding: long contexts, a context shorter than the splits, a 2-token query
    (speculative verify) and padding."""
    gen = torch.Generator().manual_seed(num_splits)
    case = make_case(
        gen,
        query_lens=(1, 1, 2, 1),
        context_lens=(260, 3, 97, 0),
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=dtype,
        soft_cap=8.0 if num_splits == 2 else None,
        pad_reqs=1,
        pad_tokens=2,
    )
    out = check(triton_attn, case, num_splits=num_splits)
    unsplit, _ = run_triton(triton_attn, case, num_splits=1)
    assert_close(out[: case.num_real_tokens], unsplit[: case.num_real_tokens].double(), dtype)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 4])
def test_bidirectional_ranges(triton_attn: ModuleType, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(11)
    case = make_case(
        gen,
        query_lens=(20, 9, 1, 12),
        context_lens=(0, 16, 30, 0),
        block_size=8,
        sliding_window=6,
        # In one chunk; in a later chunk; a decode after its span; none.
        bidirectional=[(3, 17), (17, 24), (4, 20), (0, 0)],
    )
    check(triton_attn, case, num_splits=num_splits)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 4])
def test_several_bidirectional_spans_per_request(triton_attn: ModuleType, num_splits: int) -> None:
    """[num_reqs, K, 2] ranges: two spans in one chunk (one crossing a query block), one in a
    later chunk, a decode after its spans, none."""
    gen = torch.Generator().manual_seed(13)
    case = make_case(
        gen,
        query_lens=(40, 9, 1, 12),
        context_lens=(0, 16, 30, 0),
        block_size=8,
        sliding_window=6,
        bidirectional=[[(3, 17), (20, 37)], [(17, 24)], [(4, 20), (22, 28)], [(0, 0)]],
    )
    check(triton_attn, case, num_splits=num_splits)


@interpreted
def test_key_range_bounds(triton_attn: ModuleType) -> None:
    """Query blocks whose visible keys start or end tiles away from their own positions: a
    window's start moving across tiles within one block, and a span reaching keys far after
    (and, under a small window, far before) a block's queries."""
    gen = torch.Generator().manual_seed(5)
    case = make_case(
        gen,
        query_lens=(130, 40),
        context_lens=(0, 50),
        block_size=16,
        sliding_window=4,
        bidirectional=[(10, 110), (0, 0)],
    )
    check(triton_attn, case)


def test_split_heuristic() -> None:
    from tinyvllm.attention.kernels.split_kv import choose_num_splits
    from tinyvllm.attention.kernels.unified_attention import block_shape

    assert block_shape(16, 8, 1) == (16, 8)
    assert block_shape(16, 8, 512) == (64, 32)
    assert block_shape(64, 1, 1) == (64, 1)
    assert block_shape(12, 4, 3) == (16, 5)
    # Batch 1 on 132 SMs, Qwen3-0.6B's 8 KV heads: splits grow with the context, up to 16.
    assert choose_num_splits(1, 8, 1, 4096, 8, 132) == 16
    assert choose_num_splits(1, 8, 1, 600, 8, 132) == 2
    assert choose_num_splits(1, 8, 1, 300, 8, 132) == 1
    assert choose_num_splits(16, 8, 1, 4096, 8, 132) == 2
    assert choose_num_splits(64, 8, 1, 4096, 8, 132) == 1  # the grid fills the GPU already
    assert choose_num_splits(1, 8, 40, 4096, 8, 132) == 1  # prefill
    assert choose_num_splits(1, 8, 5, 4096, 8, 132) == 16  # speculative verify


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert get_attention_backend(cpu).name == "torch"
    with pytest.raises(ValueError, match=r"CUDA device.*TRITON_INTERPRET=1.*'torch'"):
        get_attention_backend(cpu, "triton")
    with pytest.raises(ValueError, match=r"unknown attention_backend='flash'.*'triton'"):
        get_attention_backend(cpu, "flash")


@interpreted
def test_backend_choice_in_interpreter() -> None:
    cpu = torch.device("cpu")
    assert get_attention_backend(cpu, "triton").name == "triton"
    assert get_attention_backend(cpu).name == "torch"  # the interpreter is never the default
