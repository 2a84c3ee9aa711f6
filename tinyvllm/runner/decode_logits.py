"""A decode step's logits written straight into buffers that persist across steps.

`compute_logits` of a GGUF model goes through the lm_head module, its quantized weight and
the kernels' `linear` (five Python frames), allocates the GEMV's bf16 output and then its fp32
copy. After the decode program has streamed the weights through the caches, that code and two
fresh ~0.2 MB buffers miss the caches: ~0.2 ms of a ~7 ms SmolLM2 Q4_1 step at batch 1
(measured in-process, interleaved). Here the same GEMV (same kernel, format code, threads,
rounding) writes into persistent buffers, and the bf16 -> fp32 copy is the same conversion as
`.float()`, so the logits are bit for bit the ones `compute_logits` returns.

The returned tensor is a view of a buffer the next step overwrites: only for logits that are
consumed within the step (the runner's `_sample`).
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.native.abi import DTYPE_CODES
from tinyvllm.native.quant_ops import GEMV_MAX_ROWS
from tinyvllm.quant.formats import GGUFBlocks


class DecodeLogits:
    """The lm_head GEMV of steps of up to `GEMV_MAX_ROWS` rows into persistent buffers."""

    def __init__(self, packed: GGUFBlocks) -> None:
        self.kernels = packed.kernels
        self.code = packed.gemv_code
        self.weight = packed.qweight
        self.vocab = packed.qweight.shape[0]  # as `_native_linear` passes it
        self.in_features = packed.in_features
        self._rows = 0
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def build(cls, model: nn.Module) -> DecodeLogits | None:
        """For a model whose `compute_logits` is exactly `lm_head(hidden)` in fp32 over GGUF
        blocks without bias (Llama-family GGUFs); None otherwise."""
        from tinyvllm.models.llama import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM):
            return None
        if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
            return None  # e.g. a soft-capped or scaled head
        head = model.lm_head
        qweight = getattr(head, "qweight", None)
        if qweight is None or head.bias is not None:
            return None
        packed = qweight.packed
        if not isinstance(packed, GGUFBlocks) or packed.qweight.device.type != "cpu":
            return None
        return cls(packed)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits [T, vocab] of `hidden` [T, in_features] (valid until the next call),
        or None where `compute_logits` must run instead."""
        rows = hidden.shape[0]
        if (
            hidden.dtype not in (torch.bfloat16, torch.float32)
            or hidden.dim() != 2
            or hidden.shape[1] != self.in_features
            or not 0 < rows <= GEMV_MAX_ROWS
            or hidden.device.type != "cpu"
            or not hidden.is_contiguous()
        ):
            return None
        if rows > self._rows:
            self._grow(rows)
        out = self._buffers[hidden.dtype][:rows]
        self.kernels.lib.tv_linear_any(
            hidden.data_ptr(), DTYPE_CODES[hidden.dtype], self.weight.data_ptr(), self.code,
            None, 0, out.data_ptr(), rows, self.vocab, self.in_features, self.kernels.num_threads,
        )  # fmt: skip
        if hidden.dtype == torch.float32:
            return out
        return self._buffers[torch.float32][:rows].copy_(out)

    def _grow(self, rows: int) -> None:
        # Grown to the largest step seen (a decode batch), not to GEMV_MAX_ROWS up front.
        self._buffers = {
            dtype: torch.empty((rows, self.vocab), dtype=dtype)
            for dtype in (torch.bfloat16, torch.float32)
        }
        self._rows = rows
