"""Hybrid models' recurrent-state slots come out of the KV cache's memory budget."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.attention.layer import Attention
from tinyvllm.config import CacheConfig
from tinyvllm.models.layers.recurrent import RecurrentLayer, StateShape
from tinyvllm.runner.kv_cache import (
    StateSlots,
    allocate_state_tensors,
    determine_num_blocks,
    kv_bytes_per_block,
)


class _Mixer(RecurrentLayer):
    def state_shapes(self) -> list[StateShape]:
        return [StateShape((8, 3), torch.float32), StateShape((2, 4, 4), torch.float32)]


ATTN = [Attention(0, 4, 2, 16, scale=0.25)]
MIXERS = [_Mixer(), _Mixer()]
SLOT_BYTES = 2 * (8 * 3 + 2 * 4 * 4) * 4  # 448


def _size(budget: int, caching: bool, max_num_seqs: int = 4, cap: bool = False):
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=budget)
    return determine_num_blocks(
        cache, ATTN, torch.float32, torch.device("cpu"), 64, max_num_seqs,
        recurrent_layers=MIXERS, cache_state_snapshots=caching, may_cap_max_num_seqs=cap,
    )  # fmt: skip


def test_state_bytes_are_counted_in_the_kv_budget() -> None:
    per_block = kv_bytes_per_block(ATTN, 16, torch.float32)
    budget = 40 * per_block
    plain = determine_num_blocks(
        CacheConfig(block_size=16, kv_cache_memory_bytes=budget), ATTN, torch.float32,
        torch.device("cpu"), 64, 4,
    )  # fmt: skip
    assert plain.num_blocks == 40 and plain.num_running_states == 0
    size = _size(budget, caching=True)
    assert (size.num_running_states, size.num_snapshot_states) == (4, 8)
    assert size.num_blocks == (budget - 12 * SLOT_BYTES) // per_block
    off = _size(budget, caching=False)
    assert off.num_snapshot_states == 0
    assert off.num_blocks == (budget - 4 * SLOT_BYTES) // per_block


def test_snapshots_take_at_most_half_the_budget_and_running_slots_must_fit() -> None:
    plan = StateSlots.plan(MIXERS, 4, True, budget_bytes=6 * SLOT_BYTES)
    assert (plan.num_running, plan.num_snapshots) == (4, 0)
    plan = StateSlots.plan(MIXERS, 2, True, budget_bytes=10 * SLOT_BYTES)
    assert (plan.num_running, plan.num_snapshots) == (2, 3)  # half of 10, minus 2 running
    with pytest.raises(ValueError, match="max_num_seqs=4 requests needs 1792 bytes"):
        StateSlots.plan(MIXERS, 4, True, budget_bytes=3 * SLOT_BYTES)


def test_default_max_num_seqs_is_capped_to_a_quarter_of_the_budget() -> None:
    # The user left max_num_seqs at 256: running slots take at most a quarter of the budget.
    plan = StateSlots.plan(MIXERS, 256, True, budget_bytes=20 * SLOT_BYTES, may_cap_running=True)
    assert (plan.num_running, plan.num_snapshots) == (5, 5)  # half of 20, minus 5 running
    # Small enough already: not capped.
    plan = StateSlots.plan(MIXERS, 3, True, budget_bytes=20 * SLOT_BYTES, may_cap_running=True)
    assert plan.num_running == 3
    # At least one running slot when one fits at all.
    plan = StateSlots.plan(MIXERS, 256, False, budget_bytes=2 * SLOT_BYTES, may_cap_running=True)
    assert plan.num_running == 1
    with pytest.raises(ValueError, match=r"max_num_seqs=1 requests.*kv_cache_memory_bytes"):
        StateSlots.plan(MIXERS, 256, False, budget_bytes=SLOT_BYTES - 1, may_cap_running=True)
    budget = 40 * kv_bytes_per_block(ATTN, 16, torch.float32)
    size = _size(budget, True, 256, cap=True)
    assert size.num_running_states == budget // 4 // SLOT_BYTES < 256
    assert size.num_snapshot_states == size.num_running_states


def test_state_tensors_are_bound_per_layer() -> None:
    tensors = allocate_state_tensors(MIXERS, 5, torch.device("cpu"))
    assert [tuple(t.shape) for t in MIXERS[0].states] == [(5, 8, 3), (5, 2, 4, 4)]
    assert len(tensors) == 4 and all(not t.any() for t in tensors)
