"""Sizing and allocating the paged KV cache (one tensor per attention layer) and, for hybrid
models, the recurrent-state slots that share its memory budget."""

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
from tinyvllm.models.layers.recurrent import RecurrentLayer
from tinyvllm.utils.memory import keep_freed_heap_mapped

logger = logging.getLogger(__name__)

# vLLM's CPU backend reserves 4 GiB for KV by default; we never take more than a quarter of
# what is free, since the weights and activations share the same memory.
_CPU_DEFAULT_KV_BYTES = 4 << 30
_CPU_MAX_FRACTION = 0.25
# A hybrid model whose user left max_num_seqs at its default gets at most 1/this of the cache
# budget for running recurrent-state slots (snapshots take up to another quarter).
_RUNNING_SHARE = 4
# Freed heap memory the C allocator keeps mapped for the next CPU step's activations (see
# keep_freed_heap_mapped): a 4,096-token step of a ~100M-parameter model needs well under this.
_STEP_HEAP_RETAINED_BYTES = 256 << 20


@dataclass(frozen=True)
class KVCacheSize:
    """What the runner chose for the paged KV cache, handed back to the engine (which sizes
    its block pool and request limits from it) instead of written into shared config."""

    num_blocks: int
    block_size: int
    # The context the engine may serve: the configured one, or less when the user left it to
    # the model's default and the cache cannot hold one sequence that long.
    max_model_len: int
    # Hybrid models: recurrent-state slots, one per running request plus the prefix cache's
    # snapshots (0, 0: the model has no recurrent layers).
    num_running_states: int = 0
    num_snapshot_states: int = 0


@dataclass(frozen=True)
class StateSlots:
    """How many recurrent-state slots a hybrid model gets, and what one costs."""

    bytes_per_slot: int
    num_running: int
    num_snapshots: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * (self.num_running + self.num_snapshots)

    @classmethod
    def plan(
        cls,
        layers: list[RecurrentLayer],
        max_num_seqs: int,
        cache_snapshots: bool,
        budget_bytes: int | None,
        may_cap_running: bool = False,
    ) -> StateSlots:
        """One running slot per request the scheduler may run, plus (when state snapshots are
        cached) twice as many snapshot slots, fewer when the budget cannot spare half of
        itself. `may_cap_running` (the user left max_num_seqs at its default): the running
        slots take at most a quarter of the budget, so a model with a large state (Mamba2:
        tens of MiB per request) still gets snapshots and KV blocks instead of failing.
        Raises ValueError when the running slots (or, capped, one slot) do not fit."""
        per_slot = sum(layer.state_bytes() for layer in layers)
        if per_slot == 0:
            return cls(0, 0, 0)
        running = max_num_seqs
        if budget_bytes is not None:
            if may_cap_running and running * per_slot > budget_bytes // _RUNNING_SHARE:
                running = max(1, budget_bytes // _RUNNING_SHARE // per_slot)
                logger.info(
                    "recurrent state: %.2f MiB per request; running at most %d requests at "
                    "once (a quarter of the %d-byte cache budget) instead of the default "
                    "max_num_seqs=%d (set max_num_seqs or kv_cache_memory_bytes to change it)",
                    per_slot / 2**20,
                    running,
                    budget_bytes,
                    max_num_seqs,
                )
            if running * per_slot > budget_bytes:
                raise ValueError(
                    f"the recurrent state of max_num_seqs={running} requests needs "
                    f"{running * per_slot} bytes ({per_slot} per request), more than the "
                    f"KV cache budget of {budget_bytes} bytes; lower max_num_seqs or raise "
                    "kv_cache_memory_bytes (gpu_memory_utilization on a GPU)"
                )
        snapshots = 2 * running if cache_snapshots else 0
        if budget_bytes is not None:
            spare = budget_bytes // 2 - running * per_slot
            snapshots = max(0, min(snapshots, spare // per_slot))
        return cls(per_slot, running, snapshots)


# mamba_ssm_cache_dtype -> the SSM state dtype ("auto": the layers' own, float32).
_SSM_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def apply_ssm_cache_dtype(layers: list[RecurrentLayer], name: str) -> None:
    """Set the recurrent layers' SSM state dtype from the engine arg, before sizing."""
    dtype = _SSM_STATE_DTYPES.get(name)
    if dtype is None:
        return
    for layer in layers:
        layer.set_ssm_state_dtype(dtype)


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
    recurrent_layers: list[RecurrentLayer] | None = None,
    cache_state_snapshots: bool = False,
    may_cap_max_num_seqs: bool = False,
) -> KVCacheSize:
    """Number of KV blocks, from (in priority order) an exact override, an explicit byte budget,
    a GPU profiling pass with `gpu_memory_utilization`, or a CPU default.

    When the user left max_model_len to the model's
    default and the cache cannot hold one sequence that long, max_model_len shrinks to what
    fits (with a warning) instead of failing, like a long-context model on a laptop needs.

    Hybrid models (`recurrent_layers`): the state slots (`StateSlots.plan`) come out of the
    same budget first; with `num_gpu_blocks_override` they come on top of the blocks. With
    `may_cap_max_num_seqs` (max_num_seqs left at its default) fewer running slots than
    max_num_seqs may come back (`num_running_states`): the engine then runs that many at once.
    """
    per_block = kv_bytes_per_block(layers, cache.block_size, dtype)
    blocks_per_seq = -(-max_model_len // cache.block_size)
    if cache.num_gpu_blocks_override is not None:
        budget = None
        source = "num_gpu_blocks_override"
    elif cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
        source = f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        peak = profile_peak_bytes() if profile_peak_bytes is not None else 0
        used_by_others = total - free
        budget = max(int(total * cache.gpu_memory_utilization) - used_by_others - peak, 0)
        source = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
    else:
        budget = cpu_kv_budget_bytes()
        source = "CPU default"
    slots = StateSlots.plan(
        recurrent_layers or [], max_num_seqs, cache_state_snapshots, budget, may_cap_max_num_seqs
    )
    if budget is None:
        num_blocks = cache.num_gpu_blocks_override or 0
    else:
        num_blocks = (budget - slots.total_bytes) // per_block
        if source == "CPU default":
            # No point holding more than every sequence at full length can use.
            num_blocks = min(num_blocks, (slots.num_running or max_num_seqs) * blocks_per_seq)
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
    if slots.bytes_per_slot:
        logger.info(
            "recurrent state: %d running + %d snapshot slots x %.2f MiB",
            slots.num_running,
            slots.num_snapshots,
            slots.bytes_per_slot / 2**20,
        )
    return KVCacheSize(
        num_blocks, cache.block_size, max_model_len, slots.num_running, slots.num_snapshots
    )


def lazily_zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS maps on first write.

    torch.zeros writes every byte up front: for a 4 GiB CPU KV cache that is seconds of
    start-up and 4 GiB resident before the first request. Anonymous mmap memory reads as
    zeros and only the blocks actually used become resident.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # 4 KiB pages on purpose. Transparent huge pages (MADV_HUGEPAGE on a private mapping)
    # cut decode attention's TLB misses over scattered blocks (~15% of the kernel's time at 64
    # sequences x ~420 tokens), but each layer's K and V then take 2 MiB resident at their
    # first block: +118 MiB peak RSS for a one-line chat with SmolLM2-135M (494 vs 377 MiB).
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
    if device.type == "cpu":
        # The model is loaded; from here on, steps' activations reuse their heap pages.
        keep_freed_heap_mapped(_STEP_HEAP_RETAINED_BYTES)
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


def allocate_state_tensors(
    layers: list[RecurrentLayer], num_slots: int, device: torch.device
) -> list[torch.Tensor]:
    """Every recurrent layer's state tensors, `[num_slots, *shape]` each, zeroed and bound to
    the layer (`RecurrentLayer.states`); returns them all (the model state copies slots)."""
    tensors = []
    for layer in layers:
        layer.states = [
            torch.zeros((num_slots, *spec.shape), dtype=spec.dtype, device=device)
            for spec in layer.state_shapes()
        ]
        tensors.extend(layer.states)
    return tensors
