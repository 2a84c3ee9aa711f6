"""Causal prefill attention of fresh prompts on AMX tiles (native prefill_attn_amx.cpp), for
the torch backend's prefill: a step's prompts of any lengths without cached context in one call.

Why: torch's CPU flash SDPA ran a batch of 8 x 512-token prompts of a SmolLM2-135M-shaped model
at ~0.3 TFLOP/s in bf16, a quarter of the step, while the step's GEMMs run at ~2.8 TFLOP/s on
the same AMX units. The kernel reads q / k / v in place from the rows of the fused qkv
projection (no transposes or copies) and skips key tiles past each block's diagonal.
"""

from __future__ import annotations

import ctypes

import torch

from tinyvllm.attention.prompt_batch import NativePromptKernel, PromptBatch

# The kernel's head_dim (SmolLM2, Llama 3.2 1B, TinyLlama); other models keep torch's SDPA.
HEAD_DIM = 64


class AmxPrefillAttention(NativePromptKernel):
    @classmethod
    def load(cls, lib: ctypes.CDLL, num_threads: int) -> AmxPrefillAttention | None:
        """The kernel where the CPU has AMX-BF16 and the OS grants its tiles (None elsewhere)."""
        if not lib.tv_amx_supported():
            return None
        return cls(lib, num_threads, cls.team())

    @staticmethod
    def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """q [T, Hq, 64], k / v [T, Hkv, 64] in bf16 whose heads are contiguous within a row
        (views of a fused projection's rows are), Hq a multiple of Hkv."""
        if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
            return False
        if q.device.type != "cpu" or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return False
        hq, hkv = q.shape[1], k.shape[1]
        return (
            q.shape[2] == HEAD_DIM
            and k.shape[2] == HEAD_DIM
            and v.shape == k.shape
            and hkv > 0
            and hq % hkv == 0
            and all(t.stride(2) == 1 and t.stride(1) == HEAD_DIM for t in (q, k, v))
            and k.stride(0) == v.stride(0)
            and k.stride(0) % 2 == 0  # K rows are gathered as 32-bit pairs
        )

    @staticmethod
    def fits_cache(kv_cache: torch.Tensor, k: torch.Tensor) -> bool:
        """The paged cache [2, blocks, block_size, Hkv, 64] can hold the context of prompts
        (bf16, contiguous, blocks of a multiple of 16 tokens, k's KV heads)."""
        return (
            kv_cache.dtype == torch.bfloat16
            and kv_cache.dim() == 5
            and kv_cache.is_contiguous()
            and kv_cache.shape[2] % 16 == 0
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
        lens[i]) of q / k / v) into the same rows of `out` ([T, Hq, 64] bf16, heads
        contiguous); other rows of `out` are left as they are. Prompts with context follow
        their cached tokens in `kv_cache`, which must hold the step's own K / V already.
        Call only where `fits` (and with context `fits_cache`) holds."""
        self.lib.tv_prefill_attn_amx(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), batch.starts.shape[0],
            batch.starts.data_ptr(), batch.lens.data_ptr(), *self.context_args(batch, kv_cache),
            q.shape[1], k.shape[1], q.stride(0), k.stride(0), out.stride(0), scale,
            self.threads(), self.omp_parallel,
        )  # fmt: skip
