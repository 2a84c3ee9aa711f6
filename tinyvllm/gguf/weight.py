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
    `[out_features, in_features]` order.
    """

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    @property
    def qtype_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from tinyvllm.gguf.dequant import dequantize

        return dequantize(self.data, self.qtype, self.shape).to(dtype)

    def select_rows(self, index: torch.Tensor | slice) -> GGUFWeight:
        data = self.data[index]
        return GGUFWeight(data=data, qtype=self.qtype, shape=(data.shape[0], self.shape[1]))
