"""Causal prefill attention of fresh prompts on AMX tiles (native prefill_attn_amx.cpp), for
the torch backend's prefill: a step's prompts of any lengths without cached context in one call.

Why: torch's CPU flash SDPA ran a batch of 8 x 512-token prompts of a SmolLM2-135M-shaped model
at ~0.3 TFLOP/s in bf16, a quarter of the step, while the step's GEMMs run at ~2.8 TFLOP/s on
the same AMX units. The kernel reads q / k / v in place from the rows of the fused qkv
projection (no transposes or copies) and skips key tiles past each block's diagonal.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tinyvllm.native.omp_team import torch_omp_parallel

# The kernel's head_dim (SmolLM2, Llama 3.2 1B, TinyLlama); other models keep torch's SDPA.
HEAD_DIM = 64


class AmxPrefillAttention:
    def __init__(self, lib: ctypes.CDLL, num_threads: int, omp_parallel: int | None) -> None:
        self.lib = lib
        self.num_threads = num_threads
        # Where the kernel runs its items: torch's OpenMP team (see prefill_attn_amx.cpp), or
        # the library's thread pool when None.
        self.omp_parallel = omp_parallel

    @classmethod
    def load(cls, lib: ctypes.CDLL, num_threads: int) -> AmxPrefillAttention | None:
        """The kernel where the CPU has AMX-BF16 and the OS grants its tiles (None elsewhere)."""
        if not lib.tv_amx_supported():
            return None
        return cls(lib, num_threads, torch_omp_parallel())

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
        batch: AmxPromptBatch,
        scale: float,
        kv_cache: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of the batch's prompts (prompt i: rows [starts[i], starts[i] +
        lens[i]) of q / k / v) into the same rows of `out` ([T, Hq, 64] bf16, heads
        contiguous); other rows of `out` are left as they are. Prompts with context follow
        their cached tokens in `kv_cache`, which must hold the step's own K / V already.
        Call only where `fits` (and with context `fits_cache`) holds."""
        # On torch's team, as many threads as torch's own ops of this step use (the platform
        # runs long steps on one thread while another program holds a core).
        threads = self.num_threads if self.omp_parallel is None else torch.get_num_threads()
        ctx = table = k_cache = v_cache = None
        bt_stride = block_size = 0
        if batch.context_lens is not None:
            assert kv_cache is not None and batch.block_table is not None
            ctx, table = batch.context_lens.data_ptr(), batch.block_table.data_ptr()
            bt_stride = batch.block_table.stride(0)
            k_cache, v_cache = kv_cache[0].data_ptr(), kv_cache[1].data_ptr()
            block_size = kv_cache.shape[2]
        self.lib.tv_prefill_attn_amx(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), batch.starts.shape[0],
            batch.starts.data_ptr(), batch.lens.data_ptr(), ctx, table, bt_stride, k_cache,
            v_cache, block_size, q.shape[1], k.shape[1], q.stride(0), k.stride(0), out.stride(0),
            scale, threads, self.omp_parallel,
        )  # fmt: skip


class PromptSpan(Protocol):
    """A prompt (or chunk of one) of a step: rows [start, end), after context_len cached
    tokens whose blocks (and the chunk's) are block_ids."""

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor


@dataclass
class AmxPromptBatch:
    """The prompts of one kernel call: first rows and lengths (int64), and where any has
    cached tokens, their counts (int64, 0 for fresh prompts) and block table (int32, row i:
    prompt i's blocks in order). Built once per step, read by every layer."""

    spans: Sequence[PromptSpan]
    starts: torch.Tensor
    lens: torch.Tensor
    longest_keys: int  # the most keys (context and own tokens) of any prompt
    context_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None

    @classmethod
    def build(cls, spans: Sequence[PromptSpan]) -> AmxPromptBatch | None:
        if not spans:
            return None
        batch = cls(
            spans,
            torch.tensor([span.start for span in spans], dtype=torch.int64),
            torch.tensor([span.end - span.start for span in spans], dtype=torch.int64),
            max(span.context_len + span.end - span.start for span in spans),
        )
        if any(span.context_len for span in spans):
            batch.context_lens = torch.tensor(
                [span.context_len for span in spans], dtype=torch.int64
            )
            width = max(span.block_ids.shape[0] for span in spans)
            table = torch.zeros((len(spans), width), dtype=torch.int32)
            for i, span in enumerate(spans):
                table[i, : span.block_ids.shape[0]] = span.block_ids
            batch.block_table = table
        return batch
