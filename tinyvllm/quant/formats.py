"""Storage formats of a finished weight matrix W [out_features, in_features], one class each.

`PackedWeight` is the interface; `QuantizedWeight` (tinyvllm/quant/weight.py) collects a
layer's checkpoint shards, picks the first format in `FORMATS` that fits all of them, packs it
once and from then on only delegates. Kernels are bound when a format is packed (the native
block kernels, the measured dense-path thresholds), so a call only picks by batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.gguf.dequant import Q8_0, Q8_0_SUBSETS, qtype_name, to_q8_0
from tinyvllm.gguf.dequant import dequantize as dequantize_blocks
from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.native.abi import FORMAT_INT8_ACT, FORMAT_ROWS16, GGUF_FORMATS, format_code
from tinyvllm.native.ops import max_linear_rows
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.quant import kernels
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.quantize import is_gguf_int4, quantize_int4_rows, quantize_int8_rows
from tinyvllm.utils.cpu import has_native_bf16_matmul

Shard = torch.Tensor | GGUFWeight


@dataclass(frozen=True)
class WeightSpec:
    """What packing a matrix needs besides its shards: its shape, the quantization config,
    the device and model dtype it lives in, and the native CPU block kernels (None: torch
    only), chosen once for the weight."""

    in_features: int
    out_features: int
    config: QuantConfig
    device: torch.device
    model_dtype: torch.dtype
    kernels: QuantKernels | None

    @property
    def kernel_dtype(self) -> torch.dtype:
        # torch's CPU packed kernels are fast with bf16 activations and scales only (fp32 is
        # several times slower), so CPU layers compute in bf16 whatever the model dtype.
        return torch.bfloat16 if self.device.type == "cpu" else self.model_dtype


class PackedWeight(nn.Module):
    """W [out_features, in_features] in one storage format; its tensors are buffers, so they
    move, count and tie like any module's.

    Shards: a fused layer's checkpoint tensors (q/k/v, gate/up) each fill a row range;
    `QuantizedWeight` keeps them as they came until every row is in, because whether a format
    fits depends on all of them (a Q4_K q/k with a Q6_K v is neither one block matrix nor
    int4). Then `fits` is asked in `FORMATS` order and the first fitting class `pack`s the
    shards, stacked by rows, once.
    """

    name: ClassVar[str]

    def __init__(self, spec: WeightSpec) -> None:
        super().__init__()
        self.in_features = spec.in_features
        self.out_features = spec.out_features
        self.model_dtype = spec.model_dtype

    @classmethod
    def fits(cls, shards: Sequence[Shard], spec: WeightSpec) -> bool:
        """Whether this format can hold the matrix made of `shards` (in row order)."""
        raise NotImplementedError

    @classmethod
    def pack(cls, shards: Sequence[Shard], spec: WeightSpec) -> PackedWeight:
        """Convert `shards` (in row order, already on the weight's device) into this format,
        binding the kernels its products will use."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, in_features] @ W^T (+ bias) -> [M, out_features] in x's dtype."""
        raise NotImplementedError

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in the model dtype (embedding tables; only the gathered rows are
        dequantized). RuntimeError for formats that cannot select rows."""
        raise RuntimeError(
            f"row lookup needs the int8, gguf_blocks or float format, not {self.name}"
        )

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The full matrix in `dtype` (tests and debugging; the layers never build it)."""
        raise NotImplementedError

    @property
    def native_weight(self) -> tuple[int, torch.Tensor] | None:
        """(format code, tensor) for the native kernels' `tv_linear_any` and the native decode
        program (tinyvllm/native/quant_kernels.cpp), or None where they cannot read it."""
        return None

    def nbytes(self) -> int:
        """Bytes the stored format holds."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return self.name


def _native_linear(
    kernels_: QuantKernels,
    code: int,
    weight: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    # The kernels take fp32 or bf16 activations; anything else computes in fp32.
    xk = x if format_code(x.dtype) is not None else x.float()
    out = kernels_.linear(xk, code, weight, weight.shape[0], bias)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class GGUFBlocks(PackedWeight):
    """The file's GGUF blocks, uint8 [N, bytes per row] of one ggml type, computed on
    directly by the native CPU kernels."""

    name = "gguf_blocks"

    def __init__(self, spec: WeightSpec, blocks: torch.Tensor, qtype: int) -> None:
        super().__init__(spec)
        assert spec.kernels is not None
        self.kernels = spec.kernels
        self.qtype = qtype
        # The layout's code (every kernel call names it): the file's blocks, or where a GEMV
        # for this weight's activations reads it, the same blocks interleaved 16 rows at a
        # time, which the GEMVs read at 1.5-3x the speed (rows16_layout.cpp and its kernels).
        self.code = GGUF_FORMATS[qtype]
        int8 = spec.config.int8_activations
        if blocks.shape[0] % 16 == 0 and self._rows16_gemv(spec, int8):
            blocks = self.kernels.repack_rows16(self.code, blocks, spec.in_features)
            self.code |= FORMAT_ROWS16
        # The code GEMVs run with: flagged for the opt-in int8-activation kernels (the native
        # side falls back to the exact kernel for formats or CPUs they do not cover).
        self.gemv_code = self.code | (FORMAT_INT8_ACT if int8 else 0)
        self.register_buffer("qweight", blocks)

    def _rows16_gemv(self, spec: WeightSpec, int8: bool) -> bool:
        """Whether this weight's GEMVs have a kernel for the 16-row layout: the int8 ones
        (Q4_0 / Q4_1 / Q8_0), or the exact one for Q4_0 / Q4_1 against the bf16 activations
        of a bf16 model (AVX-512 kernels where the CPU has them, AVX2 ones elsewhere)."""
        if int8:
            return self.kernels.rows16_supported(self.code)
        bf16 = spec.model_dtype == torch.bfloat16
        return bf16 and self.kernels.rows16_exact_supported(self.code)

    @classmethod
    def fits(cls, shards: Sequence[Shard], spec: WeightSpec) -> bool:
        """GGUF shards of one type the native kernels read, or of types that widen to
        Q8_0 without loss, on a CPU where the kernels load."""
        if spec.config.method != "gguf" or spec.device.type != "cpu" or spec.kernels is None:
            return False
        qtypes = {shard.qtype if isinstance(shard, GGUFWeight) else None for shard in shards}
        return (len(qtypes) == 1 and qtypes <= GGUF_FORMATS.keys()) or qtypes <= Q8_0_SUBSETS

    @classmethod
    def pack(cls, shards: Sequence[Shard], spec: WeightSpec) -> PackedWeight:
        blocks = [shard for shard in shards if isinstance(shard, GGUFWeight)]
        if len(blocks) == 1 and blocks[0].owned and blocks[0].data.is_contiguous():
            # The loader's own copy of the file's blocks: kept, not copied again (a second
            # copy of the largest tensor, the embedding, set the load's peak memory).
            return cls(spec, blocks[0].data.reshape(blocks[0].shape[0], -1), blocks[0].qtype)
        if len({shard.qtype for shard in blocks}) == 1:
            # One contiguous copy (fused shards stacked by rows): nothing points into the file.
            data = torch.cat([shard.data.reshape(shard.shape[0], -1) for shard in blocks])
            return cls(spec, data, blocks[0].qtype)
        data = torch.cat([to_q8_0(shard.data, shard.qtype, shard.shape) for shard in blocks])
        return cls(spec, data, Q8_0)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _native_linear(self.kernels, self.gemv_code, self.qweight, x, bias)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        dtype = self.model_dtype if format_code(self.model_dtype) is not None else torch.float32
        rows = self.kernels.embedding(self.code, self.qweight, self.in_features, ids, dtype)
        return rows.to(self.model_dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.code & FORMAT_ROWS16:  # the native rows give the same bits as the reference
            rows = self.kernels.dequantize_rows(
                self.code, self.qweight, self.in_features, 0, self.out_features
            )
            return rows.to(dtype)
        shape = (self.out_features, self.in_features)
        return dequantize_blocks(self.qweight, self.qtype, shape).to(dtype)

    @property
    def native_weight(self) -> tuple[int, torch.Tensor] | None:
        return self.gemv_code, self.qweight

    def extra_repr(self) -> str:
        int8 = ", int8 activations" if self.gemv_code != self.code else ""
        return f"{self.name} {qtype_name(self.qtype)}{int8}"


class FloatRows(PackedWeight):
    """The exact values in the model dtype (`QuantConfig.exact` tensors no block kernel
    reads); on CPU the native kernels take decode-sized products, torch's GEMM the rest."""

    name = "float"

    def __init__(self, spec: WeightSpec, weight: torch.Tensor) -> None:
        super().__init__(spec)
        self.register_buffer("qweight", weight)
        code = format_code(weight.dtype) if spec.device.type == "cpu" else None
        self.kernels = spec.kernels if code is not None else None
        self.code = code if self.kernels is not None else None
        self.max_native_rows = max_linear_rows(weight.dtype)

    @classmethod
    def fits(cls, shards: Sequence[Shard], spec: WeightSpec) -> bool:
        return spec.config.exact

    @classmethod
    def pack(cls, shards: Sequence[Shard], spec: WeightSpec) -> PackedWeight:
        dtype = spec.model_dtype
        parts = [s.dequantize(dtype) if isinstance(s, GGUFWeight) else s.to(dtype) for s in shards]
        return cls(spec, torch.cat(parts).contiguous())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernels is None or self.code is None or x.shape[0] > self.max_native_rows:
            return F.linear(x, self.qweight.to(x.dtype), bias)
        return _native_linear(self.kernels, self.code, self.qweight, x, bias)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.qweight)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype)

    @property
    def native_weight(self) -> tuple[int, torch.Tensor] | None:
        # The native decode program reads float rows even where the layer's own products
        # stay in torch (kernels not loaded here).
        code = format_code(self.qweight.dtype) if self.qweight.device.type == "cpu" else None
        return None if code is None else (code, self.qweight)


def _dense_min_rows(measured: int) -> int:
    # The dense path dodges packed kernels that run on emulated bf16; CPUs with native bf16
    # dot products (not measured here) keep the packed kernels at every batch size.
    return 1 << 62 if has_native_bf16_matmul() else measured


class Int8Rows(PackedWeight):
    """int8 [N, K] with one symmetric scale per row [N]: w = q * scale. Fits any matrix (the
    fallback of the other formats)."""

    name = "int8"

    def __init__(self, spec: WeightSpec, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(spec)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.dense_min_rows = _dense_min_rows(kernels.CPU_DENSE_MIN_ROWS_INT8)

    @classmethod
    def fits(cls, shards: Sequence[Shard], spec: WeightSpec) -> bool:
        return True

    @classmethod
    def pack(cls, shards: Sequence[Shard], spec: WeightSpec) -> PackedWeight:
        parts = [quantize_int8_rows(shard, spec.kernel_dtype) for shard in shards]
        q = torch.cat([q for q, _ in parts]) if len(parts) > 1 else parts[0][0]
        scale = torch.cat([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
        return cls(spec, q, scale)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = kernels.int8_linear(x, self.qweight, self.scale, self.dense_min_rows)
        return y if bias is None else y + bias

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].float() * self.scale[ids].float().unsqueeze(-1)
        return rows.to(self.model_dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return kernels.dequantize_int8(self.qweight, self.scale, dtype)


class Int4Groups(PackedWeight):
    """4-bit values with a scale and zero per group of input columns: w = (q - 8) * scale +
    zero. `qweight` uint8 [N(+pad), K / 2] in the device's layout (torch's CPU int4pack,
    padded to whole row blocks, else `pack_nibbles`), `scales_zeros` [K / G, N(+pad), 2]."""

    name = "int4"

    def __init__(self, spec: WeightSpec, qweight: torch.Tensor, scales_zeros: torch.Tensor) -> None:
        super().__init__(spec)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_zeros", scales_zeros)
        self.cpu_layout = spec.device.type == "cpu"
        self.dense_min_rows = _dense_min_rows(kernels.CPU_DENSE_MIN_ROWS_INT4)

    @classmethod
    def fits(cls, shards: Sequence[Shard], spec: WeightSpec) -> bool:
        if spec.config.method == "int8":
            return False
        if spec.config.method == "gguf":
            return all(is_gguf_int4(shard) for shard in shards)
        return spec.in_features % spec.config.group_size == 0

    @classmethod
    def pack(cls, shards: Sequence[Shard], spec: WeightSpec) -> PackedWeight:
        # GGUF 4-bit blocks come in groups of 32; other shards of the same matrix follow suit.
        group = 32 if any(is_gguf_int4(s) for s in shards) else spec.config.group_size
        parts = [quantize_int4_rows(s, group, spec.kernel_dtype) for s in shards]
        q = torch.cat([p.q for p in parts])
        scale = torch.cat([p.scale for p in parts])
        zero = torch.cat([p.zero for p in parts])
        if spec.device.type == "cpu":
            pad = -spec.out_features % kernels.cpu_int4_block_rows()
            if pad:  # padding rows compute zeros that `int4_linear` drops
                q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
                scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
                zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
            packed = kernels.pack_int4_cpu(q)
        else:
            packed = kernels.pack_nibbles(q)
        return cls(spec, packed, torch.stack([scale.t(), zero.t()], dim=-1).contiguous())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = kernels.int4_linear(
            x, self.qweight, self.scales_zeros, self.out_features, self.dense_min_rows
        )
        return y if bias is None else y + bias

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.cpu_layout:
            q = kernels.unpack_int4_cpu(self.qweight, 0, self.qweight.shape[0])
        else:
            q = kernels.unpack_nibbles(self.qweight)
        return kernels.dequantize_int4(q, self.scales_zeros, dtype)[: self.out_features]

    def extra_repr(self) -> str:
        return f"{self.name}, group={self.in_features // self.scales_zeros.shape[0]}"


# The order `QuantizedWeight` tries them in: keep the file's blocks where the kernels read
# them, never requantize exact tables, int4 where its groups fit, int8 for everything else.
FORMATS: tuple[type[PackedWeight], ...] = (GGUFBlocks, FloatRows, Int4Groups, Int8Rows)
