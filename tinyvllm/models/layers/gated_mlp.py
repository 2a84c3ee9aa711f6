"""A gated MLP, down(act(gate_up(x))), as every model's MLP computes it.

Where its linears run on fp32 GEMM copies (CPUs without bf16 matmul, large inputs), the rows go
in blocks whose fp32 gate / up output stays under FP32_BLOCK_BYTES: under glibc's largest mmap
threshold (32 MiB), so each block's output is served from heap pages the previous one freed
instead of a fresh mapping whose every page faults in (4,096 rows of SmolLM2-135M, one 50 MB
output: 64 vs 50 ms per gate / up GEMM on a 2-core Ice Lake). With SiLU, bf16 rows and the
AVX-512 row kernels, the activation also stays in fp32 storage between the two GEMMs: the
native kernel rounds its input and output to bf16 where the bf16 path rounds, so the result is
the same bits without the conversion passes around the [T, 2 * intermediate] and
[T, intermediate] activations (94 vs 101 ms a layer there). Elsewhere each block takes the
activation in x's dtype, as the plain path does.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.models.layers.activation import SiluAndMul
from tinyvllm.models.layers.linear import LinearBase

FP32_BLOCK_BYTES = 16 << 20


def gated_mlp(
    gate_up: LinearBase, act: nn.Module, down: LinearBase, x: torch.Tensor
) -> torch.Tensor:
    out = _on_fp32_copies(gate_up, act, down, x) if x.dim() == 2 else None
    return down(act(gate_up(x))) if out is None else out


def _on_fp32_copies(
    gate_up: LinearBase, act: nn.Module, down: LinearBase, x: torch.Tensor
) -> torch.Tensor | None:
    """The MLP of x's rows in blocks on the fp32 GEMM copies; None where the copies do not
    take the first block (blocks are as even as can be, so the first is the largest)."""
    native = act.native if isinstance(act, SiluAndMul) else None
    fused = (
        native if native is not None and native.row_kernels and x.dtype == torch.bfloat16 else None
    )
    rows = x.shape[0]
    blocks = max(1, -(-rows * gate_up.output_size * 4 // FP32_BLOCK_BYTES))
    out: torch.Tensor | None = None
    r0 = 0
    for part in x.tensor_split(blocks):
        y = gate_up.fp32_gemm(part)
        if y is None:
            if out is None:
                return None
            block = down(act(gate_up(part)))  # too few rows for the copies: the plain path
        else:
            h = fused.silu_mul_bf16_in_f32(y) if fused is not None else act(y.to(x.dtype))
            del y  # its pages go back to the heap for the next block's
            fp32 = down.fp32_gemm(h)
            block = down(h.to(x.dtype)) if fp32 is None else fp32
        if out is None:
            out = torch.empty((rows, block.shape[1]), dtype=x.dtype)
        out[r0 : r0 + part.shape[0]] = block
        r0 += part.shape[0]
    return out
