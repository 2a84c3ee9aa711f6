"""The prompts and chunks of a step that a native prefill attention kernel attends in one call
(prefill_amx.py on AMX, prefill_f32.py elsewhere), and what those kernels share."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tinyvllm.native.omp_team import torch_omp_parallel


class PromptSpan(Protocol):
    """A prompt (or chunk of one) of a step: rows [start, end), after context_len cached
    tokens whose blocks (and the chunk's) are block_ids."""

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor


@dataclass
class PromptBatch:
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
    def build(cls, spans: Sequence[PromptSpan]) -> PromptBatch | None:
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


# ctypes arguments of a batch's cached context: context lengths, block table, its row stride,
# K cache, V cache, block size (null pointers and zeros: no prompt has context).
ContextArgs = tuple[int | None, int | None, int, int | None, int | None, int]


class NativePromptKernel:
    """What the native prefill kernels share: the library, and where their items run."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int, omp_parallel: int | None) -> None:
        self.lib = lib
        self.num_threads = num_threads
        # Where the kernel runs its items: torch's OpenMP team (see native/omp_team.h), or
        # the library's thread pool when None.
        self.omp_parallel = omp_parallel

    def threads(self) -> int:
        """On torch's team, as many threads as torch's own ops of this step use (the platform
        runs long steps on one thread while another program holds a core)."""
        return self.num_threads if self.omp_parallel is None else torch.get_num_threads()

    @staticmethod
    def team() -> int | None:
        """torch's OpenMP team for a kernel loaded now (None: the thread pool)."""
        return torch_omp_parallel()

    @staticmethod
    def context_args(batch: PromptBatch, kv_cache: torch.Tensor | None) -> ContextArgs:
        if batch.context_lens is None:
            return None, None, 0, None, None, 0
        assert kv_cache is not None and batch.block_table is not None
        return (
            batch.context_lens.data_ptr(),
            batch.block_table.data_ptr(),
            batch.block_table.stride(0),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            kv_cache.shape[2],
        )
