"""A weight-only quantized [out_features, in_features] matrix that a layer computes with.

Checkpoint tensors (float, or raw GGUF blocks) arrive as row ranges: a fused layer gets
one per shard. They are kept as they came until every row is covered, because the storage
format of a fused GGUF layer depends on all of its shards (Q4_K q/k with a Q6_K v cannot
be one block matrix, nor int4). Then they are converted once and dropped, so a streamed load
holds at most one layer's raw shards beyond the packed model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.gguf.dequant import dequantize as dequantize_blocks
from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.native.ops import max_linear_rows
from tinyvllm.native.quant_ops import GGUF_FORMATS, format_code, quant_kernels
from tinyvllm.quant import kernels
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.quantize import is_gguf_int4, quantize_int4_rows, quantize_int8_rows
from tinyvllm.utils.cpu import has_native_bf16_matmul


def _kernel_dtype(device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    # torch's CPU packed kernels are fast with bf16 activations and scales only (fp32 is
    # several times slower), so CPU layers compute in bf16 whatever the model dtype.
    return torch.bfloat16 if device.type == "cpu" else model_dtype


class QuantizedWeight(nn.Module):
    """Packed weight plus its scales; `linear(x)` computes x @ W^T.

    Buffers (set by `finalize`): int8 format: `qweight` int8 [N, K], `scale` [N];
    int4 format: `qweight` uint8 [N(+pad), K / 2] in the device's layout,
    `scales_zeros` [K / G, N(+pad), 2]; gguf_blocks format: `qweight` uint8
    [N, bytes per row], the file's blocks of type `gguf_qtype` (native CPU kernels);
    float format (exact configs whose tensors no kernel reads): `qweight` [N, K] in the model
    dtype. Device and model dtype are taken from the construction context
    (`with torch.device(...)`, default dtype), like a parameter's.
    """

    def __init__(self, in_features: int, out_features: int, config: QuantConfig) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.config = config
        probe = torch.empty(0)
        self.device = probe.device
        self.model_dtype = probe.dtype
        self.kernel_dtype = _kernel_dtype(self.device, self.model_dtype)
        self.format: str | None = None
        self.gguf_qtype: int | None = None
        self.dense_min_rows = 0
        self.register_buffer("qweight", None)
        self.register_buffer("scale", None)
        self.register_buffer("scales_zeros", None)
        # row offset -> shard, until every row has arrived
        self._pending: dict[int, torch.Tensor | GGUFWeight] = {}

    @property
    def ready(self) -> bool:
        return self.format is not None

    def load_rows(self, loaded: torch.Tensor | GGUFWeight, offset: int, rows: int) -> None:
        """Take rows [offset, offset + rows) from a checkpoint tensor; converts the whole
        matrix once the last rows are in. ValueError on a shape that does not fit."""
        if not isinstance(loaded, GGUFWeight | torch.Tensor):
            raise ValueError(f"cannot quantize a {type(loaded).__name__}")
        expected = (rows, self.in_features)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected shape {expected}, got {tuple(loaded.shape)}")
        if self.ready:
            raise ValueError("the quantized weight was already loaded")
        self._pending[offset] = loaded
        if sum(shard.shape[0] for shard in self._pending.values()) >= self.out_features:
            self.finalize()

    def finalize(self) -> None:
        """Convert the pending shards into the packed format (idempotent)."""
        if self.ready:
            return
        covered = sorted((off, shard.shape[0]) for off, shard in self._pending.items())
        end = 0
        for offset, rows in [*covered, (self.out_features, 0)]:
            if offset != end:
                raise ValueError(f"rows {end}..{offset} of the quantized weight never arrived")
            end = offset + rows
        shards = [self._shard_on_device(self._pending[off]) for off, _ in covered]
        self._pending = {}
        if self._blocks_fit(shards):
            self._keep_blocks(shards)  # type: ignore[arg-type]
        elif self.config.exact:
            self._keep_float(shards)
        elif self._int4_fits(shards):
            self._pack_int4(shards)
        else:
            self._pack_int8(shards)

    def _shard_on_device(self, shard: torch.Tensor | GGUFWeight) -> torch.Tensor | GGUFWeight:
        if isinstance(shard, GGUFWeight):
            return GGUFWeight(shard.data.to(self.device), shard.qtype, shard.shape)
        return shard.to(self.device)

    def _blocks_fit(self, shards: list[torch.Tensor | GGUFWeight]) -> bool:
        """GGUF shards of one type the native kernels read, on a CPU where they load."""
        if self.config.method != "gguf" or self.device.type != "cpu" or quant_kernels() is None:
            return False
        qtypes = {shard.qtype if isinstance(shard, GGUFWeight) else None for shard in shards}
        return len(qtypes) == 1 and qtypes.pop() in GGUF_FORMATS

    def _keep_blocks(self, shards: list[GGUFWeight]) -> None:
        # One contiguous copy (fused shards stacked by rows): nothing points into the file.
        self.qweight = torch.cat([shard.data.reshape(shard.shape[0], -1) for shard in shards])
        self.gguf_qtype = shards[0].qtype
        self.format = "gguf_blocks"

    def _keep_float(self, shards: list[torch.Tensor | GGUFWeight]) -> None:
        parts = [
            s.dequantize(self.model_dtype) if isinstance(s, GGUFWeight) else s.to(self.model_dtype)
            for s in shards
        ]
        self.qweight = torch.cat(parts).contiguous()
        self.format = "float"

    @property
    def native_weight(self) -> tuple[int, torch.Tensor] | None:
        """(format code, tensor) for the native kernels' `tv_linear_any` (see
        tinyvllm/native/quant_kernels.cpp), or None where they cannot read this weight."""
        if self.format == "gguf_blocks":
            assert self.gguf_qtype is not None
            return GGUF_FORMATS[self.gguf_qtype], self.qweight
        if self.format == "float" and self.device.type == "cpu":
            code = format_code(self.qweight.dtype)
            return None if code is None else (code, self.qweight)
        return None

    def _int4_fits(self, shards: list[torch.Tensor | GGUFWeight]) -> bool:
        if self.config.method == "int8":
            return False
        if self.config.method == "gguf":
            return all(is_gguf_int4(shard) for shard in shards)
        return self.in_features % self.config.group_size == 0

    def _pack_int8(self, shards: list[torch.Tensor | GGUFWeight]) -> None:
        parts = [quantize_int8_rows(shard, self.kernel_dtype) for shard in shards]
        self.qweight = torch.cat([q for q, _ in parts]) if len(parts) > 1 else parts[0][0]
        self.scale = torch.cat([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
        self.format = "int8"
        self.dense_min_rows = self._dense_min_rows(kernels.CPU_DENSE_MIN_ROWS_INT8)

    def _pack_int4(self, shards: list[torch.Tensor | GGUFWeight]) -> None:
        # GGUF 4-bit blocks come in groups of 32; other shards of the same matrix follow suit.
        group = 32 if any(is_gguf_int4(s) for s in shards) else self.config.group_size
        parts = [quantize_int4_rows(s, group, self.kernel_dtype) for s in shards]
        q = torch.cat([p.q for p in parts])
        scale = torch.cat([p.scale for p in parts])
        zero = torch.cat([p.zero for p in parts])
        if self.device.type == "cpu":
            pad = -self.out_features % kernels.cpu_int4_block_rows()
            if pad:  # padding rows compute zeros that `int4_linear` drops
                q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
                scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
                zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
            self.qweight = kernels.pack_int4_cpu(q)
        else:
            self.qweight = kernels.pack_nibbles(q)
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
        self.format = "int4"
        self.dense_min_rows = self._dense_min_rows(kernels.CPU_DENSE_MIN_ROWS_INT4)

    def _dense_min_rows(self, measured: int) -> int:
        # The dense path dodges packed kernels that run on emulated bf16; CPUs with native
        # bf16 dot products (not measured here) keep the packed kernels at every batch size.
        return 1 << 62 if has_native_bf16_matmul() else measured

    def _check_ready(self) -> None:
        if not self.ready:
            raise RuntimeError(
                "quantized weight used before all of its checkpoint rows were loaded"
            )

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self._check_ready()
        x2 = x.reshape(-1, self.in_features)
        if self.format in ("gguf_blocks", "float"):
            return self._native_linear(x2, bias).reshape(*x.shape[:-1], self.out_features)
        if self.format == "int8":
            y = kernels.int8_linear(x2, self.qweight, self.scale, self.dense_min_rows)
        else:
            y = kernels.int4_linear(
                x2, self.qweight, self.scales_zeros, self.out_features, self.dense_min_rows
            )
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _native_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        native = self.native_weight
        kernels_ = quant_kernels()
        if (
            native is None
            or kernels_ is None
            or (self.format == "float" and x.shape[0] > max_linear_rows(self.qweight.dtype))
        ):
            # Off CPU or without the kernels, and large batches on float tables: torch's GEMM.
            return F.linear(x, self.qweight.to(x.dtype), bias)
        fmt, weight = native
        xk = x if format_code(x.dtype) is not None else x.float()
        y = kernels_.linear(xk, fmt, weight, self.out_features, bias)
        return y.to(x.dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in the model dtype (int8, gguf_blocks and float formats)."""
        self._check_ready()
        if self.format == "float":
            return F.embedding(ids, self.qweight)
        if self.format == "gguf_blocks":
            assert self.gguf_qtype is not None
            kernels_ = quant_kernels()
            assert kernels_ is not None
            dtype = self.model_dtype if format_code(self.model_dtype) is not None else torch.float32
            rows = kernels_.embedding(
                GGUF_FORMATS[self.gguf_qtype], self.qweight, self.in_features, ids, dtype
            )
            return rows.to(self.model_dtype)
        if self.format != "int8":
            raise RuntimeError("row lookup needs the int8, gguf_blocks or float format")
        rows = self.qweight[ids].float() * self.scale[ids].float().unsqueeze(-1)
        return rows.to(self.model_dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full float matrix (for tests and debugging; the layers never build it)."""
        self._check_ready()
        if self.format == "gguf_blocks":
            assert self.gguf_qtype is not None
            shape = (self.out_features, self.in_features)
            return dequantize_blocks(self.qweight, self.gguf_qtype, shape).to(dtype)
        if self.format == "float":
            return self.qweight.to(dtype)
        if self.format == "int8":
            return kernels.dequantize_int8(self.qweight, self.scale, dtype)
        if self.device.type == "cpu":
            q = kernels.unpack_int4_cpu(self.qweight, 0, self.qweight.shape[0])
        else:
            q = kernels.unpack_nibbles(self.qweight)
        w = kernels.dequantize_int4(q, self.scales_zeros, dtype)
        return w[: self.out_features]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        fmt = self.format or "pending"
        if self.format == "int4":
            fmt += f", group={self.in_features // self.scales_zeros.shape[0]}"
        if self.gguf_qtype is not None:
            from tinyvllm.gguf.dequant import qtype_name

            fmt += f" {qtype_name(self.gguf_qtype)}"
        return f"in={self.in_features}, out={self.out_features}, {fmt}"
