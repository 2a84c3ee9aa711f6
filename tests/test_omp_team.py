"""Where torch's OpenMP workers spin between its ops (no wait policy chosen: torch was
imported before tinyvllm), the row kernels of the steps torch runs go to torch's own team
instead of the native pool (tinyvllm/native/omp_team.py); decode steps on the native program
keep the pool. Same kernels, same bits either way."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import unsupported_reason
from tinyvllm.native.omp_team import torch_omp_parallel

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None or torch_omp_parallel() is None,
    reason="needs the native kernels and torch on an OpenMP runtime",
)


def test_row_kernels_on_the_team_match_the_pool() -> None:
    ops = NativeCpuOps.load(2)  # two threads: the pool runs (and counts) its regions
    if ops is None or not ops.row_kernels:
        pytest.skip("no AVX-512 row kernels on this CPU")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 192, generator=gen).to(torch.bfloat16)
    res = torch.randn(300, 192, generator=gen).to(torch.bfloat16)
    w = torch.randn(192, generator=gen).to(torch.bfloat16)
    gate_up = torch.randn(300, 384, generator=gen).to(torch.bfloat16)

    def run() -> list[torch.Tensor]:
        r = res.clone()
        return [ops.rms_norm(x, r, w, 1e-6), r, ops.silu_mul(gate_up)]

    before = _pool_regions(ops)
    pool = run()
    assert _pool_regions(ops) > before  # the pool's threads ran the rows
    ops.row_team = torch_omp_parallel()
    try:
        before = _pool_regions(ops)
        team = run()
        assert _pool_regions(ops) == before  # torch's team did, not the pool
    finally:
        ops.row_team = None
    assert all(torch.equal(a, b) for a, b in zip(pool, team, strict=True))


def _pool_regions(ops: NativeCpuOps) -> int:
    """Regions the native pool has run, with its workers or alone (tv_pool_stats)."""
    stats = (ctypes.c_int64 * 5)()
    ops.lib.tv_pool_stats(stats)
    return stats[0] + stats[1]


@pytest.mark.parametrize("team", [False, True], ids=["pool", "team"])
def test_a_prefill_store_of_many_rows_matches_the_row_by_row_copy(team: bool) -> None:
    """From MIN_PARALLEL_STORE_ROWS rows on, the K / V store runs over blocks of rows on all
    threads: same cache bytes as the one-thread copy, padding slots (-1) skipped."""
    from tinyvllm.native.ops import MIN_PARALLEL_STORE_ROWS

    ops = NativeCpuOps.load()
    assert ops is not None
    gen = torch.Generator().manual_seed(1)
    t = MIN_PARALLEL_STORE_ROWS + 37
    qkv = torch.randn(t, 3, 2, 8, generator=gen).to(torch.bfloat16)  # fused rows: strided K, V
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(4 * t, generator=gen)[:t].to(torch.int64)
    slots[::17] = -1
    cache = torch.zeros(2, 4 * t, 2, 8, dtype=torch.bfloat16)
    ops.row_team = torch_omp_parallel() if team else None
    try:
        ops.store_kv(key, value, cache.view(2, 4 * t, 2, 8), slots)
    finally:
        ops.row_team = None
    want = torch.zeros_like(cache)
    keep = slots >= 0
    want[0, slots[keep]] = key[keep]
    want[1, slots[keep]] = value[keep]
    assert torch.equal(cache, want)


def _teams_seen(llm: LLM) -> tuple[list[tuple[int, int | None]], list[list[int]]]:
    ops = llm.engine.runner.platform.native
    seen: list[tuple[int, int | None]] = []
    norm = ops.rms_norm

    def recorded(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((x.shape[0], ops.row_team))
        return norm(x, *args)

    ops.rms_norm = recorded
    # 100 + 90 rows in one step: more than the native program takes, so torch runs it.
    prompts = [{"prompt_token_ids": list(range(s, s + n))} for s, n in ((5, 100), (120, 90))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return seen, [list(o.outputs[0].token_ids) for o in outs]


def test_prefill_row_kernels_go_to_the_spinning_team(tiny_models, monkeypatch) -> None:
    import tinyvllm.platforms.cpu as cpu

    ops = NativeCpuOps.load()
    if ops is None or not ops.row_kernels:
        pytest.skip("no AVX-512 row kernels on this CPU: prefill rows run in torch")
    path = str(tiny_models["llama"])
    monkeypatch.setattr(cpu, "omp_waits_spin", lambda: True)
    spinning = LLM(path, dtype="bfloat16", max_model_len=128)
    seen, tokens = _teams_seen(spinning)
    team = torch_omp_parallel()
    assert [t for rows, t in seen if rows > 1] and all(t == team for rows, t in seen if rows > 1)
    assert spinning.engine.runner.platform.native.row_team is None  # reset after each step
    monkeypatch.setattr(cpu, "omp_waits_spin", lambda: False)  # a chosen (passive) policy
    passive = LLM(path, dtype="bfloat16", max_model_len=128)
    seen_passive, tokens_passive = _teams_seen(passive)
    assert seen_passive and all(t is None for _, t in seen_passive)
    assert tokens == tokens_passive
