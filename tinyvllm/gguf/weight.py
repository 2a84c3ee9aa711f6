"""A 2-D GGUF tensor kept in its block-quantized form until a layer decides what to do with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGUFWeight:
    """Raw GGUF blocks of one weight matrix.

    `data` is uint8 `[rows, bytes_per_row]`: each row is `cols / block_elems` consecutive
    blocks, so row subsets and row permutations (fused-shard slicing, the llama q/k head
    permutation) work on the raw bytes without dequantizing. `qtype` is the
    `gguf.GGMLQuantizationType` value; `shape` is the logical `(rows, cols)` in torch's
    `[out_features, in_features]` order. `owned`: `data` is memory of its own (not a view of
    the mapped file, nor of a caller's array), which a layer may keep without copying.
    """

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    owned: bool = False

    @property
    def qtype_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from tinyvllm.gguf.dequant import dequantize

        return dequantize(self.data, self.qtype, self.shape).to(dtype)

    def select_rows(self, index: torch.Tensor | slice) -> GGUFWeight:
        data = self.data[index]
        # Indexing with a tensor copies; a slice is a view of the same memory.
        owned = self.owned or not isinstance(index, slice)
        return GGUFWeight(data, self.qtype, (data.shape[0], self.shape[1]), owned)
