"""Sizing and allocating the paged KV cache (one tensor per attention layer)."""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyvllm.attention.backend import AttentionBackend
from tinyvllm.attention.layer import Attention
from tinyvllm.config import CacheConfig

logger = logging.getLogger(__name__)

# vLLM's CPU backend reserves 4 GiB for KV by default; we never take more than a quarter of
# what is free, since the weights and activations share the same memory.
_CPU_DEFAULT_KV_BYTES = 4 << 30
_CPU_MAX_FRACTION = 0.25


@dataclass(frozen=True)
class KVCacheSize:
    """What the runner chose for the paged KV cache, handed back to the engine (which sizes
    its block pool and request limits from it) instead of written into shared config."""

    num_blocks: int
    block_size: int
    # The context the engine may serve: the configured one, or less when the user left it to
    # the model's default and the cache cannot hold one sequence that long.
    max_model_len: int


def kv_bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * elem for layer in layers)


def _available_cpu_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def cpu_kv_budget_bytes() -> int:
    """What the KV cache may take on the CPU by default."""
    return min(_CPU_DEFAULT_KV_BYTES, int(_available_cpu_memory() * _CPU_MAX_FRACTION))


def max_kv_tokens(cache: CacheConfig, per_token_bytes: int, device: torch.device) -> int:
    """An upper bound on the tokens the KV cache can hold, known before the model loads (the
    real number, after profiling, is never larger)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override * cache.block_size
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = int(torch.cuda.get_device_properties(device).total_memory)
    else:
        budget = cpu_kv_budget_bytes()
    return budget // max(per_token_bytes, 1)


def determine_num_blocks(
    cache: CacheConfig,
    layers: list[Attention],
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    profile_peak_bytes: Callable[[], int] | None = None,
    may_shrink_max_model_len: bool = False,
) -> KVCacheSize:
    """Number of KV blocks, from (in priority order) an exact override, an explicit byte budget,
    a GPU profiling pass with `gpu_memory_utilization`, or a CPU default.

    When the user left max_model_len to the model's
    default and the cache cannot hold one sequence that long, max_model_len shrinks to what
    fits (with a warning) instead of failing, like a long-context model on a laptop needs.
    """
    per_block = kv_bytes_per_block(layers, cache.block_size, dtype)
    blocks_per_seq = -(-max_model_len // cache.block_size)
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
        source = "num_gpu_blocks_override"
    elif cache.kv_cache_memory_bytes is not None:
        num_blocks = cache.kv_cache_memory_bytes // per_block
        source = f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        peak = profile_peak_bytes() if profile_peak_bytes is not None else 0
        used_by_others = total - free
        budget = int(total * cache.gpu_memory_utilization) - used_by_others - peak
        num_blocks = max(budget, 0) // per_block
        source = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
    else:
        budget = cpu_kv_budget_bytes()
        # No point holding more than every sequence at full length can use.
        num_blocks = min(budget // per_block, max_num_seqs * blocks_per_seq)
        source = "CPU default"
    if num_blocks < blocks_per_seq and may_shrink_max_model_len and num_blocks > 0:
        fitted = num_blocks * cache.block_size
        logger.warning(
            "the KV cache (%s) holds %d tokens, less than the model's context of %d; "
            "serving with max_model_len=%d (pass max_model_len or more KV memory to change it)",
            source,
            fitted,
            max_model_len,
            fitted,
        )
        max_model_len = fitted
    elif num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache ({source}) holds {num_blocks} blocks of {cache.block_size} tokens = "
            f"{num_blocks * cache.block_size} tokens, fewer than one sequence of max_model_len="
            f"{max_model_len}; lower max_model_len or give the KV cache more memory"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens (%.1f MiB, %s)",
        num_blocks,
        cache.block_size,
        num_blocks * per_block / 2**20,
        source,
    )
    return KVCacheSize(num_blocks, cache.block_size, max_model_len)


def lazily_zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS maps on first write.

    torch.zeros writes every byte up front: for a 4 GiB CPU KV cache that is seconds of
    start-up and 4 GiB resident before the first request. Anonymous mmap memory reads as
    zeros and only the blocks actually used become resident.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    # frombuffer keeps `buf` alive for as long as the tensor (or a view of it) lives.
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def allocate_kv_caches(
    layers: list[Attention],
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    caches = []
    for layer in layers:
        shape = backend.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        if device.type == "cpu":
            cache = lazily_zeroed_cpu_tensor(shape, dtype)
        else:
            cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.kv_cache = cache
        layer.backend = backend
        caches.append(cache)
    return caches
