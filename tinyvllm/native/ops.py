"""Typed Python faces of the native CPU kernels (see cpu_kernels.cpp).

Each method takes and returns torch tensors and checks only what the kernels assume
(dtype, contiguity, small row counts); callers decide when the native path applies with
`NativeCpuOps.can_linear` and friends and otherwise run their PyTorch code.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from tinyvllm.native.abi import DTYPE_CODES as _DTYPE_CODES
from tinyvllm.native.abi import format_code as dtype_code
from tinyvllm.native.build import load_library
from tinyvllm.native.step_threads import NATIVE_STALE_TRIAL_COST, StepThreadChoice
from tinyvllm.utils.cpu import native_threads

# Input rows up to which the native kernel beats torch: with bf16 weights up to 64 rows
# (measured on a 2-core AVX2 EPYC, one thread, SmolLM2-135M's layer shapes: 2.5x less CPU time
# than fp32 MKL on weight copies at 8 rows, 1.2x at 64); with fp32 weights the two tie at 16
# rows and MKL's blocked GEMM wins beyond.
MAX_LINEAR_ROWS = 64
MAX_FP32_LINEAR_ROWS = 16
# The element-wise kernels of cpu_kernels.cpp run on one thread: past a few dozen rows torch's
# vectorised, multi-threaded ops are faster, and the dispatch overhead they save no longer
# matters. Where the CPU has AVX-512, inputs of any size go to row_kernels.cpp instead, which
# split rows over the thread pool and fuse what eager runs as several ops: they win from one
# row up (SiLU * up over 64 x 1536: 0.08 vs 0.59 ms on a 2-core Sapphire Rapids; scalar expf
# made a 64-row decode step on the layers spend 19 ms of 170 in this op alone).
MAX_ELEMENTWISE_ROWS = 64
# Rows from which a K / V store is split over the threads (decode steps copy a few rows).
MIN_PARALLEL_STORE_ROWS = 256


def max_linear_rows(weight_dtype: torch.dtype) -> int:
    return MAX_FP32_LINEAR_ROWS if weight_dtype == torch.float32 else MAX_LINEAR_ROWS


def elementwise_rows_fit(x: torch.Tensor) -> bool:
    """`x` can go to an element-wise kernel: 2-D rows of unit inner stride in a kernel dtype,
    few enough rows (see MAX_ELEMENTWISE_ROWS)."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ELEMENTWISE_ROWS
        and x.stride(1) == 1
        and dtype_code(x.dtype) is not None
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeCpuOps:
    """The loaded kernel library (its functions bound by `abi.bind`) plus the thread count it
    runs with."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self.lib = lib
        self.num_threads = num_threads
        self.step_threads = StepThreadChoice(num_threads, stale_trial_cost=NATIVE_STALE_TRIAL_COST)
        # Whether the AVX-512 row kernels (any number of rows) run on this CPU.
        self.row_kernels = bool(lib.tv_rows_supported())
        # Whether bf16 linears of 2+ rows run on AMX tiles (amx_linear.cpp).
        self.amx_linears = bool(lib.tv_amx_supported())
        # GOMP_parallel of torch's OpenMP runtime while the row kernels (norms, SiLU, rope) of
        # a step torch runs go to its team, whose workers spin between torch's ops (set by the
        # CPU platform per step where torch's waits spin, see utils/omp.py); None: the pool.
        self.row_team: int | None = None
        # False during a decode step the route sent to torch's GEMMs (CpuPlatform.start_step):
        # linears leave even decode-sized inputs to torch.
        self.gemv_linears = True

    def elementwise_fits(self, x: torch.Tensor) -> bool:
        """`x` can go to `rms_norm` / `silu_mul` / `rope_`: like `elementwise_rows_fit`, with
        any number of rows where the row kernels run."""
        return (
            x.dim() == 2
            and (x.shape[0] <= MAX_ELEMENTWISE_ROWS or self.row_kernels)
            and x.stride(1) == 1
            and dtype_code(x.dtype) is not None
        )

    @classmethod
    def load(cls, num_threads: int | None = None) -> NativeCpuOps | None:
        lib = load_library()
        if lib is None:
            return None
        return cls(lib, num_threads or native_threads())

    def can_linear(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            self.gemv_linears
            and x.dim() == 2
            and x.shape[0] <= max_linear_rows(weight.dtype)
            and x.dtype in _DTYPE_CODES
            and weight.dtype in _DTYPE_CODES
            and x.is_contiguous()
            and weight.is_contiguous()
        )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty((m, n), dtype=x.dtype)
        self.lib.tv_linear(
            x.data_ptr(), _DTYPE_CODES[x.dtype], weight.data_ptr(), _DTYPE_CODES[weight.dtype],
            _ptr(bias), 0 if bias is None else _DTYPE_CODES[bias.dtype], out.data_ptr(),
            m, n, k, self.num_threads,
        )  # fmt: skip
        return out

    def bf16_pairs_fit(self, weight: torch.Tensor) -> bool:
        """Whether `bf16_pairs` repacks `weight` (else it returns None)."""
        return (
            bool(self.lib.tv_bf16_pairs_supported())
            and weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.shape[0] % 16 == 0
            and weight.shape[1] % 2 == 0
        )

    def bf16_pairs(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A bf16 weight [N, K] repacked for `tv_linear_any`'s code `FORMAT_BF16 |
        FORMAT_ROWS16` (bf16_pairs.cpp: 16 rows interleaved in pairs of columns; same bytes),
        or None where this CPU's best kernels do not read that layout (they do on AVX-512
        without BF16 dot products) or the shape does not fit it (N % 16, K % 2)."""
        if not self.bf16_pairs_fit(weight):
            return None
        src = weight.detach().contiguous()
        out = torch.empty_like(src)
        n, k = src.shape
        self.lib.tv_repack_bf16_pairs(src.data_ptr(), n, k, out.data_ptr(), self.num_threads)
        return out

    # ---- element-wise ---------------------------------------------------------------------
    def rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """Normalised x (after `residual += x` in place when a residual is given)."""
        t, h = x.shape
        out = torch.empty_like(x)
        args = (x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(),
                _DTYPE_CODES[x.dtype], t, h, eps)  # fmt: skip
        if self.row_kernels:
            self.lib.tv_rows_rms_norm(*args, *self._row_threads())
        else:
            self.lib.tv_rms_norm(*args)
        return out

    def _row_threads(self) -> tuple[int, int | None]:
        """(threads, team) of a row kernel: the pool's threads, or as many of torch's team as
        torch's ops of this step use."""
        if self.row_team is None:
            return self.num_threads, None
        return torch.get_num_threads(), self.row_team

    def head_norm_(self, x: torch.Tensor, head_dim: int, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm each head of x [T, heads * head_dim] in place (rows may be strided)."""
        self.lib.tv_head_norm(
            x.data_ptr(), x.stride(0), x.shape[1] // head_dim, head_dim, weight.data_ptr(),
            _DTYPE_CODES[x.dtype], x.shape[0], eps,
        )  # fmt: skip

    def _gated(self, fn: Any, x: torch.Tensor) -> torch.Tensor:
        t, d2 = x.shape
        out = torch.empty((t, d2 // 2), dtype=x.dtype)
        fn(x.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype], t, d2 // 2)
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_kernels:
            t, d2 = x.shape
            out = torch.empty((t, d2 // 2), dtype=x.dtype)
            self.lib.tv_rows_silu_mul(
                x.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype], t, d2 // 2,
                *self._row_threads(),
            )  # fmt: skip
            return out
        return self._gated(self.lib.tv_silu_mul, x)

    def silu_mul_bf16_in_f32(self, x: torch.Tensor) -> torch.Tensor:
        """`silu_mul` of fp32 rows [T, 2 * D] rounded to bf16, its bf16 results kept in fp32
        storage ([T, D]): for an fp32 GEMM's output feeding another fp32 GEMM. Row kernels only
        (`row_kernels`); x contiguous."""
        t, d2 = x.shape
        out = torch.empty((t, d2 // 2), dtype=torch.float32)
        self.lib.tv_rows_silu_mul_bf16_in_f32(
            x.data_ptr(), out.data_ptr(), t, d2 // 2, *self._row_threads()
        )
        return out

    def gelu_tanh_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gated(self.lib.tv_gelu_tanh_mul, x)

    def rope_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        head_dim: int,
        rotary_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate q [T, Hq * D] and k [T, Hkv * D] in place (rows may be strided views)."""
        args = (
            q.data_ptr(), q.stride(0), q.shape[1] // head_dim, k.data_ptr(), k.stride(0),
            k.shape[1] // head_dim, _DTYPE_CODES[q.dtype], q.shape[0], head_dim, rotary_dim,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        )  # fmt: skip
        if self.row_kernels:
            self.lib.tv_rows_rope(*args, *self._row_threads())
        else:
            self.lib.tv_rope(*args)

    # ---- paged KV -------------------------------------------------------------------------
    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """key/value [T, Hkv, D] (row-strided views allowed) -> kv_cache at slots."""
        t, hkv, d = key.shape
        args = (
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), t, hkv * d,
            key.element_size(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            slots.data_ptr(),
        )  # fmt: skip
        if t >= MIN_PARALLEL_STORE_ROWS:  # a prefill step: on all threads
            self.lib.tv_rows_store_kv(*args, *self._row_threads())
        else:
            self.lib.tv_store_kv(*args)

    def paged_decode(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        token_idx: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
    ) -> None:
        """out[token_idx] = attention of query[token_idx] over each row's cached context.

        query [T, Hq, D] with contiguous heads (token rows may be strided); out contiguous.
        """
        _, num_blocks, block_size, hkv, d = kv_cache.shape
        self.lib.tv_paged_decode(
            query.data_ptr(), query.stride(0), out.data_ptr(), _DTYPE_CODES[query.dtype],
            token_idx.shape[0], token_idx.data_ptr(), rows.data_ptr(), None, seq_lens.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), kv_cache.data_ptr(), num_blocks,
            block_size, query.shape[1], hkv, d, scale, sliding_window or 0, soft_cap or 0.0,
            self.num_threads,
        )  # fmt: skip


def attach_native_ops(model: torch.nn.Module, ops: NativeCpuOps | None) -> int:
    """Hand `ops` to every layer that has a native path (its class declares `native`);
    None detaches. Returns the number of layers touched."""
    count = 0
    for module in model.modules():
        if any("native" in vars(cls) for cls in type(module).mro()):
            module.native = ops
            count += 1
    return count
