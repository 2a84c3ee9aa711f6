"""Linear layers whose parameters know how to load checkpoint tensors.

HF checkpoints store q/k/v and gate/up as separate tensors; we keep them fused so one
matmul does the work. Every parameter carries `weight_loader(param, loaded, shard_id)`,
which copies a checkpoint tensor into the right rows of the (possibly fused) parameter.
With a `QuantConfig` a layer keeps its weight packed in a `QuantizedWeight`
(tinyvllm.quant) instead, which both the weight loader and `forward` go through.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.gguf.weight import GGUFWeight
from tinyvllm.models.layers.fp32_copy import Fp32WeightCopy
from tinyvllm.native.ops import NativeCpuOps
from tinyvllm.quant.config import QuantConfig
from tinyvllm.quant.weight import QuantizedWeight
from tinyvllm.utils.cpu import has_native_bf16_matmul


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None: ...


def _check_shape(expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"expected shape {tuple(expected)}, got {tuple(got)}")


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
) -> None:
    """Copy a whole tensor into an unfused parameter (casting to the parameter's dtype).

    Raw GGUF blocks are dequantized here: a float parameter of a quantized model (the
    embedding and lm_head under quantization="gguf") takes the file's exact values.
    """
    if shard_id is not None:
        raise ValueError(f"unfused parameter got a shard id {shard_id!r}")
    if isinstance(loaded, GGUFWeight):
        loaded = loaded.dequantize(param.dtype).to(param.device)
    _check_shape(param.shape, loaded.shape)
    param.data.copy_(loaded)


def new_parameter(*shape: int, loader: WeightLoader = default_weight_loader) -> nn.Parameter:
    """An uninitialised inference-only parameter: every value is overwritten by the loader,
    so random init would only cost time on large models."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(nn.Module):
    """y = x @ W^T (+ b) for inputs [..., input_size] -> [..., output_size].

    Subclasses decide how checkpoint tensors map onto their parameters; `forward` is
    the only thing the model calls, so a quantized implementation can slot in.
    """

    # Native CPU kernels (set by the runner): decode-sized inputs read the weight directly.
    native: NativeCpuOps | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.qweight: QuantizedWeight | None = None
        if quant_config is None:
            self.weight = new_parameter(output_size, input_size, loader=self.weight_loader)
        else:
            self.qweight = QuantizedWeight(input_size, output_size, quant_config)
            # An empty parameter that only routes checkpoint tensors by name to `qweight`.
            self.weight = new_parameter(0, loader=self.quantized_weight_loader)
        self.bias = new_parameter(output_size, loader=self.weight_loader) if bias else None
        # Optional GEMM copy of the weight for inputs of `gemm_min_rows` to `gemm_max_rows`
        # rows, made on the first such input within `gemm_budget`: an fp32 copy (`fp32_copy`,
        # see `attach_fp32_gemm_weights`) or, with `gemm_packed`, the weight prepacked in
        # oneDNN's blocked layout (`gemm_weight`, see `attach_packed_gemm_weights`). Other
        # inputs use the weight.
        self.fp32_copy: Fp32WeightCopy | None = None
        self.gemm_weight: torch.Tensor | None = None
        self.gemm_min_rows = 0
        self.gemm_max_rows: int | None = None
        self.gemm_packed = False
        self.gemm_budget: Fp32CopyBudget | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        default_weight_loader(param, loaded, shard_id)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        """(first output row, number of rows) that a checkpoint shard fills."""
        if shard_id is not None:
            raise ValueError(f"unfused parameter got a shard id {shard_id!r}")
        return 0, self.output_size

    def quantized_weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        assert self.qweight is not None
        offset, size = self.shard_range(shard_id)
        self.qweight.load_rows(loaded, offset, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.linear(x, self.bias)
        if self.native is not None:
            # Leading dims flattened: an encoder's [streams, frames, hidden] chunk is rows too.
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if self.native.can_linear(rows, self.weight):
                out = self.native.linear(rows, self.weight, self.bias)
                return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
        if self._takes_gemm_copy(x.shape[0]):
            if self.gemm_packed:
                return torch.ops.mkldnn._linear_pointwise(
                    x, self.gemm_weight, self.bias, "none", [], ""
                )
            assert self.fp32_copy is not None
            return self.fp32_copy(x).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def fp32_gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        """x's rows [T, in] through the fp32 GEMM copy, the fp32 result not rounded to x's
        dtype (None where `forward` would not take that copy): for a caller that fuses the
        rounding into the next op. x may hold bf16 values in fp32 storage."""
        if self.qweight is not None or self.gemm_packed or x.dim() != 2:
            return None
        if self.native is not None and self.native.can_linear(x, self.weight):
            return None
        if not self._takes_gemm_copy(x.shape[0]):
            return None
        assert self.fp32_copy is not None
        return self.fp32_copy(x)

    def _takes_gemm_copy(self, rows: int) -> bool:
        """Whether `rows` rows run on the GEMM copy, making it now if the budget allows
        (once refused, the layer stays on its own weight)."""
        if not self.gemm_min_rows or rows < self.gemm_min_rows:
            return False
        if self.gemm_max_rows is not None and rows > self.gemm_max_rows:
            return False
        if self.gemm_weight is not None or self.fp32_copy is not None:
            return True
        nbytes = self.weight.numel() * (self.weight.element_size() if self.gemm_packed else 4)
        if self.gemm_budget is None or not self.gemm_budget.take(nbytes):
            self.gemm_min_rows = 0
            return False
        if self.gemm_packed:
            self.gemm_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            return True
        self.fp32_copy = Fp32WeightCopy(self.weight, self.bias)
        return True

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A plain linear layer loaded from one checkpoint tensor."""


class _ShardedLinear(LinearBase):
    """Output rows are the concatenation of named shards, each its own checkpoint tensor."""

    def __init__(
        self,
        input_size: int,
        shard_sizes: dict[str | int, int],
        bias: bool,
        quant_config: QuantConfig | None = None,
    ) -> None:
        offsets: dict[str | int, tuple[int, int]] = {}
        total = 0
        for shard_id, size in shard_sizes.items():
            offsets[shard_id] = (total, size)
            total += size
        super().__init__(input_size, total, bias, quant_config)
        self.shard_offsets = offsets

    @property
    def shard_ids(self) -> list[str | int]:
        return list(self.shard_offsets)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {self.shard_ids}")
        return self.shard_offsets[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        offset, size = self.shard_range(shard_id)
        target = param.data.narrow(0, offset, size)
        _check_shape(target.shape, loaded.shape)
        target.copy_(loaded)


class QKVLinear(_ShardedLinear):
    """Fused q/k/v projection: output is [q (Hq*D) | k (Hkv*D) | v (Hkv*D)].

    Shard ids are "q", "k" and "v".
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        quant_config: QuantConfig | None = None,
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        shards: dict[str | int, int] = {"q": q_size, "k": kv_size, "v": kv_size}
        super().__init__(hidden_size, shards, bias, quant_config)
        self.q_size = q_size
        self.kv_size = kv_size

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class MergedColumnLinear(_ShardedLinear):
    """Several projections of the same input stacked along the output (e.g. gate and up).

    Shard ids are the integer positions 0, 1, ... of `output_sizes`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__(input_size, dict(enumerate(output_sizes)), bias, quant_config)
        self.output_sizes = list(output_sizes)


@dataclass
class Fp32CopyBudget:
    """Bytes GEMM weight copies may still take (None: no limit), shared by every layer of
    the models one platform runs. `reserved`: what the layers' GEMM copies, made on first use,
    may still ask for (each ask, granted or not, ends its reservation); `take_spare` (the
    native decode program's copies) leaves it to them, since a prefill GEMM gains more from its
    copy than a decode batch."""

    left: int | None = None
    spent: int = 0
    reserved: int = 0

    def take(self, nbytes: int) -> bool:
        """For a layer's GEMM copy."""
        self.reserved = max(0, self.reserved - nbytes)
        return self._spend(nbytes)

    def take_spare(self, nbytes: int) -> bool:
        """For another copy, past what is reserved."""
        if self.left is not None and nbytes > self.left - self.reserved:
            return False
        return self._spend(nbytes)

    def _spend(self, nbytes: int) -> bool:
        if self.left is not None:
            if nbytes > self.left:
                return False
            self.left -= nbytes
        self.spent += nbytes
        return True


def attach_fp32_gemm_weights(
    model: nn.Module, min_rows: int, budget: Fp32CopyBudget | None = None
) -> int:
    """Let linear layers use an fp32 copy of their weight for inputs with >= `min_rows` rows.

    On CPUs without native bf16 matmul (AVX2 only), torch's batched bf16 GEMM runs several
    times slower than fp32, while a single-row bf16 GEMV is memory-bound and wins on bytes.
    Keeping both copies gives prefill and batched decode fp32 speed and batch-1 decode bf16
    bandwidth. Quantized layers are skipped: an fp32 copy would undo their memory saving
    (their kernels pick a dense path for large batches themselves).

    A copy is made on the layer's first input of `min_rows` rows or more, while `budget` has
    room: memory goes only to layers whose GEMMs need it. With the native decode path only
    prefill chunks reach these GEMMs, so a chat model's lm_head (one row per sequence) never
    takes its copy. Returns the bytes the copies may take at most.
    """
    budget = Fp32CopyBudget() if budget is None else budget
    most = 0
    for module in _float_linears(model):
        module.gemm_min_rows = min_rows
        module.gemm_budget = budget
        most += module.weight.numel() * 4
    return most


def packed_gemm_supported(dtype: torch.dtype) -> bool:
    """Whether torch can run `dtype` GEMMs on oneDNN-prepacked weights here."""
    mkldnn = torch.ops.mkldnn
    # oneDNN packs bf16 only where the CPU has bf16 instructions (AVX512-BF16 / AMX; AVX2
    # CPUs fail in the reorder), and only there do the copies pay.
    return (
        dtype == torch.bfloat16
        and has_native_bf16_matmul()
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def attach_packed_gemm_weights(
    model: nn.Module, min_rows: int, max_rows: int, budget: Fp32CopyBudget | None = None
) -> int:
    """Let bf16 linear layers run inputs of `min_rows` to `max_rows` rows on a copy of their
    weight prepacked in oneDNN's blocked layout (the same bf16 values: bitwise the same
    results as `F.linear`).

    Where torch's bf16 matmul runs on AMX, `F.linear` reorders the weight into that layout on
    every call: for a decode batch's few dozen rows this is a third of the GEMM's time (SmolLM2-
    135M's 120 linears at 64 rows: 29 ms plain, 21 ms prepacked, on 2 Sapphire Rapids cores);
    a prefill chunk's thousands of rows amortise it. Copies are made on first use within
    `budget` (each the bf16 weight's bytes), so a model that never runs a batched decode step on
    its layers never takes them. Returns the bytes the copies may take at most."""
    budget = Fp32CopyBudget() if budget is None else budget
    most = 0
    for module in _float_linears(model):
        if module.weight.dtype != torch.bfloat16:
            continue
        module.gemm_min_rows, module.gemm_max_rows = min_rows, max_rows
        module.gemm_packed = True
        module.gemm_budget = budget
        most += module.weight.numel() * module.weight.element_size()
    return most


def _float_linears(model: nn.Module) -> Iterator[LinearBase]:
    """Linear layers of `model` with a float weight, each weight once (tied weights share)."""
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, LinearBase) or module.qweight is not None:
            continue
        if id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        yield module
