"""The decode program's bf16 linears in the pair layout (bf16_pairs.cpp), made when a step
first needs them.

On CPUs whose best GEMM reads that layout (`NativeCpuOps.bf16_pairs`: AVX-512 without BF16)
a step of 8-64 rows runs 1.2-1.9x faster on it, a single row no faster (memory-bound either
way). The copy costs 1x the bf16 bytes, so it is made at the first step of
`PAIRS_MIN_REQUESTS` requests or more (a decode batch): a chat that only ever runs one
sequence never pays for it (its prompt steps run on the rows). The weights the model's own
layers read stay as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tinyvllm.native.abi import FORMAT_BF16, FORMAT_ROWS16, TvLayer
from tinyvllm.native.ops import NativeCpuOps

FORMAT_PAIRS = FORMAT_BF16 | FORMAT_ROWS16
# Requests in the first step that makes the copies: decode batches below it gain ~1.2x at
# most, a single sequence nothing.
PAIRS_MIN_REQUESTS = 8
LINEARS = ("qkv", "o", "gate_up", "down")

logger = logging.getLogger(__name__)


class PairCopies:
    """bf16 linears of bound layers (`TvLayer` fields `<name>_w` / `<name>_fmt`) waiting for
    their copies, taken within `take_copy_bytes` (the platform's weight-copy budget; None: no
    limit) when `make` runs."""

    def __init__(
        self, ops: NativeCpuOps, take_copy_bytes: Callable[[int], bool] | None = None
    ) -> None:
        self.ops = ops
        self.take_copy_bytes = take_copy_bytes
        self.pending: list[tuple[TvLayer, str, torch.Tensor]] = []
        self.keep: list[torch.Tensor] = []  # the copies the layers point into

    def note(self, layer: TvLayer, name: str, weight: torch.Tensor) -> None:
        """`layer`'s linear `name` reads the bf16 rows `weight` until `make` repacks it."""
        if getattr(layer, f"{name}_fmt") == FORMAT_BF16 and self.ops.bf16_pairs_fit(weight):
            self.pending.append((layer, name, weight))

    def make(self) -> None:
        """Repack every pending linear the budget grants (in layer order), once."""
        for layer, name, weight in self.pending:
            if self.take_copy_bytes is not None and not self.take_copy_bytes(weight.nbytes):
                continue
            packed = self.ops.bf16_pairs(weight)
            assert packed is not None  # bf16_pairs_fit held when noted
            self.keep.append(packed)
            setattr(layer, f"{name}_w", packed.data_ptr())
            setattr(layer, f"{name}_fmt", FORMAT_PAIRS)
        logger.info(
            "decode program: %d of %d bf16 linears repacked to the pair layout (%.0f MiB)",
            len(self.keep),
            len(self.pending),
            sum(t.nbytes for t in self.keep) / 2**20,
        )
        self.pending.clear()
