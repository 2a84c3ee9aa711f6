"""The peak memory of the largest forward the scheduler may send, measured on a GPU.

The KV cache gets what is left of the memory budget after the weights and this peak, so the
forward runs once, before the cache exists, on a throwaway cache of just enough blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.runner.kv_cache import allocate_kv_caches, allocate_state_tensors

if TYPE_CHECKING:
    from tinyvllm.runner.model_runner import ModelRunner


def profile_peak_bytes(runner: ModelRunner) -> int:
    """Run the largest batch the scheduler may send, on a throwaway cache; return the peak."""
    sched = runner.config.scheduler
    num_tokens = min(sched.max_num_batched_tokens, runner.config.model.max_model_len)
    num_blocks = -(-num_tokens // runner.block_size)
    allocate_kv_caches(
        runner.layers, runner.backend, num_blocks, runner.block_size, runner.dtype, runner.device
    )
    allocate_state_tensors(runner.recurrent_layers, 1, runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    base = torch.cuda.memory_allocated(runner.device)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=runner.device)[None]
    metadata = AttentionMetadata(
        num_reqs=1,
        num_actual_tokens=num_tokens,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=runner.device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=runner.device),
        block_table=block_table,
        slot_mapping=torch.arange(num_tokens, device=runner.device),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
        block_size=runner.block_size,
    )
    inputs = runner.model_state.dummy_inputs(metadata)
    runner.backend.plan(metadata)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, metadata)
        runner.model.compute_logits(hidden[-sched.max_num_seqs :])
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - base
    for layer in runner.layers:
        layer.kv_cache = None
    for rec in runner.recurrent_layers:
        rec.states = []
    torch.cuda.empty_cache()
    return peak
