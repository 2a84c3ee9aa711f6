"""Write each token's K and V into the paged cache at its slot (slot -1: padding, skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    block = (slot // BLOCK_SIZE).to(tl.int64)
    offset = (slot % BLOCK_SIZE).to(tl.int64)
    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] -> k_cache/v_cache [num_blocks, block_size, Hkv, D] at the slots.

    Only shapes are read on the host (CUDA-graph safe). Tokens past `slot_mapping`'s length
    are ignored; the cache's dtype may differ from the inputs' (the store casts).
    """
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
