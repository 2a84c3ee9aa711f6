"""Causal prefill attention in fp32 on FMA units (native prefill_attn_f32.h, AVX2 or AVX-512
Foundation), for the torch backend's prefill on CPUs without AMX: a step's prompts and chunks,
with or without cached context, in one call.

Why: where bf16 dot products are missing, prefill attention is computed in fp32. torch's flash
SDPA ran it at ~90 GFLOP/s on a 2-core Ice Lake (a fifth of a 4,096-token step of a
SmolLM2-135M-shaped model) after copying q / k / v to fp32, and a prompt with cached context
took one masked SDPA call of its own over context gathered from the cache. The kernel reads q /
k / v (bf16 or fp32) in place from the rows of the fused projection, skips key tiles past each
query tile's diagonal and reads cached context through the block table.
"""

from __future__ import annotations

import ctypes

import torch

from tinyvllm.attention.prompt_batch import NativePromptKernel, PromptBatch

# head_dim: a multiple of the AVX2 kernel's 16-dim pass, up to its buffers' 256.
_DIM_STEP = 16
MAX_HEAD_DIM = 256
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class Fp32PrefillAttention(NativePromptKernel):
    @classmethod
    def load(cls, lib: ctypes.CDLL, num_threads: int) -> Fp32PrefillAttention:
        return cls(lib, num_threads, cls.team())

    @staticmethod
    def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """q [T, Hq, D], k / v [T, Hkv, D] of one dtype (bf16 or fp32) whose heads are
        contiguous within a row (views of a fused projection's rows are), Hq a multiple of
        Hkv, D a multiple of 16 up to 256."""
        if q.dtype not in _DTYPE_CODES or k.dtype != q.dtype or v.dtype != q.dtype:
            return False
        if q.device.type != "cpu" or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return False
        hq, hkv, dim = q.shape[1], k.shape[1], q.shape[2]
        return (
            dim % _DIM_STEP == 0
            and 0 < dim <= MAX_HEAD_DIM
            and k.shape[2] == dim
            and v.shape == k.shape
            and hkv > 0
            and hq % hkv == 0
            and all(t.stride(2) == 1 and t.stride(1) == dim for t in (q, k, v))
            and k.stride(0) == v.stride(0)
        )

    @staticmethod
    def fits_cache(kv_cache: torch.Tensor, k: torch.Tensor) -> bool:
        """The paged cache [2, blocks, block_size, Hkv, D] holds k's dtype and heads."""
        return (
            kv_cache.dtype == k.dtype
            and kv_cache.dim() == 5
            and kv_cache.is_contiguous()
            and kv_cache.shape[3:] == k.shape[1:]
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        batch: PromptBatch,
        scale: float,
        kv_cache: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of the batch's prompts (prompt i: rows [starts[i], starts[i] +
        lens[i]) of q / k / v, after context_lens[i] cached tokens) into the same rows of
        `out` ([T, Hq, D] in q's dtype, heads contiguous); other rows of `out` are left as
        they are. With context, `kv_cache` must hold the step's own K / V already. Call only
        where `fits` (and with context `fits_cache`) holds."""
        assert out.dtype == q.dtype and out.stride(2) == 1 and out.stride(1) == q.shape[2]
        self.lib.tv_prefill_attn_f32(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), _DTYPE_CODES[q.dtype],
            batch.starts.shape[0], batch.starts.data_ptr(), batch.lens.data_ptr(),
            *self.context_args(batch, kv_cache), q.shape[1], k.shape[1], q.shape[2],
            q.stride(0), k.stride(0), out.stride(0), scale, self.threads(), self.omp_parallel,
        )  # fmt: skip
