"""A weight-only quantized [out_features, in_features] matrix that a layer computes with.

Checkpoint tensors (float, or raw GGUF blocks) arrive as row ranges: a fused layer gets
one per shard. They are kept as they came until every row is covered, because the storage
format of a fused GGUF layer depends on all of its shards (see tinyvllm/quant/formats.py).
Then they are packed once into that format and dropped, so a streamed load holds at most one
layer's raw shards beyond the packed model.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.formats import FORMATS, PackedWeight, Shard, WeightSpec


class QuantizedWeight(nn.Module):
    """Collects a layer's checkpoint rows, then computes with them in one storage format.

    `packed` (a `PackedWeight`, None until every row has arrived) holds the tensors; this
    class only checks shapes and readiness and delegates. Device and model dtype are taken
    from the construction context (`with torch.device(...)`, default dtype), like a
    parameter's. `kernels` are the native CPU block kernels the platform chose (None: torch
    only); `bind_quant_kernels` hands them over after construction, before any row arrives.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: QuantConfig,
        kernels: QuantKernels | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.config = config
        self.kernels = kernels
        probe = torch.empty(0)
        self.device = probe.device
        self.model_dtype = probe.dtype
        self.packed: PackedWeight | None = None
        # row offset -> shard, until every row has arrived
        self._pending: dict[int, Shard] = {}

    @property
    def ready(self) -> bool:
        return self.packed is not None

    @property
    def format(self) -> str | None:
        """The storage format's name (for logs and tests), None while rows are pending."""
        return None if self.packed is None else self.packed.name

    def load_rows(self, loaded: Shard, offset: int, rows: int) -> None:
        """Take rows [offset, offset + rows) from a checkpoint tensor; packs the whole
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
        """Pack the pending shards into the first format that fits them (idempotent)."""
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
        spec = WeightSpec(
            self.in_features,
            self.out_features,
            self.config,
            self.device,
            self.model_dtype,
            self._native_kernels(),
        )
        fmt = next(f for f in FORMATS if f.fits(shards, spec))
        self.packed = fmt.pack(shards, spec)

    def _native_kernels(self) -> QuantKernels | None:
        # Only the formats that keep a file's values (GGUF blocks, exact floats) use the
        # native kernels; int8 / int4 weights stay in torch's packed kernels.
        if self.device.type != "cpu" or not (self.config.method == "gguf" or self.config.exact):
            return None
        return self.kernels

    def _shard_on_device(self, shard: Shard) -> Shard:
        if isinstance(shard, GGUFWeight):
            data = shard.data.to(self.device)
            # A copy to another device is memory of its own as well.
            owned = shard.owned or data.data_ptr() != shard.data.data_ptr()
            return GGUFWeight(data, shard.qtype, shard.shape, owned)
        return shard.to(self.device)

    def _checked(self) -> PackedWeight:
        if self.packed is None:
            raise RuntimeError(
                "quantized weight used before all of its checkpoint rows were loaded"
            )
        return self.packed

    @property
    def native_weight(self) -> tuple[int, torch.Tensor] | None:
        """(format code, tensor) for the native kernels and decode program, or None where
        they cannot read this weight (see `PackedWeight.native_weight`)."""
        return None if self.packed is None else self.packed.native_weight

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_features] @ W^T (+ bias) -> [..., out_features]."""
        if x.dim() == 2 and x.shape[1] == self.in_features:
            # Rows already: no reshape round trip (two dispatches per call on the decode path).
            return self._checked().linear(x, bias)
        y = self._checked().linear(x.reshape(-1, self.in_features), bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in the model dtype (int8, gguf_blocks and float formats)."""
        return self._checked().embedding(ids)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full float matrix (for tests and debugging; the layers never build it)."""
        return self._checked().dequantize(dtype)

    def nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.nbytes()

    def extra_repr(self) -> str:
        pending = "" if self.ready else ", pending"
        return f"in={self.in_features}, out={self.out_features}{pending}"


def bind_quant_kernels(model: nn.Module, kernels: QuantKernels | None) -> None:
    """Give every quantized weight of `model` the native block kernels chosen for it (None:
    torch only). Packing picks the storage format with them, so this runs before the weights
    load; RuntimeError for a weight already packed."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            if module.ready:
                raise RuntimeError(f"{name}: kernels bound after the weight was packed")
            module.kernels = kernels


def finalize_quantized_weights(model: nn.Module) -> None:
    """Pack any quantized weight still holding raw shards; ValueError naming the module
    whose rows never all arrived."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            try:
                module.finalize()
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
