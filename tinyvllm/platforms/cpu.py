"""The CPU platform: the native kernels (tinyvllm/native/) where they load, and fp32 copies
of GEMM weights where the CPU has no bf16 matmul."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionBackend
from tinyvllm.attention.cpu_native import NativeCpuAttentionBackend
from tinyvllm.models.layers.linear import (
    Fp32CopyBudget,
    attach_fp32_gemm_weights,
    attach_packed_gemm_weights,
    packed_gemm_supported,
)
from tinyvllm.native.decode_route import DecodeRoute
from tinyvllm.native.llama_decode import LlamaDecodeProgram
from tinyvllm.native.ops import NativeCpuOps, attach_native_ops
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.native.step_threads import LONG_STEP_TOKENS, StepThreadChoice
from tinyvllm.platforms.interface import Platform
from tinyvllm.utils.cpu import (
    FP32_GEMM_MIN_ROWS,
    has_native_bf16_matmul,
    torch_intra_op_threads,
)

logger = logging.getLogger(__name__)

# Row counts whose bf16 GEMMs run on oneDNN-prepacked weight copies where the CPU has bf16
# matmul (attach_packed_gemm_weights): decode batches the route sends to the layers, and small
# mixed steps. Fewer rows run on the native program (a single stream never takes the copies,
# not even in the route's trials of the layers); a prefill chunk's thousands of rows amortise
# oneDNN's per-call reorder of the plain weight.
PACKED_GEMM_MIN_ROWS = 8
PACKED_GEMM_MAX_ROWS = 256


class CpuPlatform(Platform):
    """`native`: the loaded kernel library (None: torch ops only, as under enforce_eager or
    where the library cannot build). With it, decode steps run through native kernels that
    cut per-op dispatch and read weights and paged KV in place: the CPU counterpart of CUDA
    graphs."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        native: NativeCpuOps | None,
        fp32_weight_copy_bytes: int | None = None,
    ) -> None:
        super().__init__(device, dtype)
        self.native = native
        # fp32 GEMM weight copies are made on first use within this; target and draft share it.
        self.fp32_copy_budget = Fp32CopyBudget(fp32_weight_copy_bytes)
        self.name = "cpu" if native is None else "cpu_native"
        # torch's intra-op threads per torch-run step: all, or one when that measures faster
        # (another program on the cores makes every OpenMP region wait for its time slice).
        self.torch_threads = StepThreadChoice(
            torch.get_num_threads(), max_interval=256, first_samples=2
        )
        # Program or layers per decode step (decode_route.py); set with a bf16 program on a
        # CPU with bf16 dot products, None elsewhere (every step the program supports).
        self.decode_route: DecodeRoute | None = None
        self._quant_kernels = (
            None if native is None else QuantKernels(native.lib, native.num_threads)
        )

    @property
    def quant_kernels(self) -> QuantKernels | None:
        return self._quant_kernels

    @property
    def native_layer_ops(self) -> bool:
        return self.native is not None

    def routes_to_program(self, num_tokens: int) -> bool:
        route = self.decode_route
        return route is None or route.takes_program(num_tokens)

    @contextlib.contextmanager
    def native_step(self, num_tokens: int) -> Iterator[None]:
        if self.native is None:
            yield
            return
        with self._routed(num_tokens), self.native.step(num_tokens):
            yield

    @contextlib.contextmanager
    def _routed(self, num_tokens: int) -> Iterator[None]:
        """Times a step the decode route picked (either path); other steps pass through."""
        if self.decode_route is None:
            yield
            return
        with self.decode_route.timed(num_tokens):
            yield

    @contextlib.contextmanager
    def torch_step(self, num_tokens: int) -> Iterator[None]:
        route = self.decode_route
        if route is not None and route.take_layers_step():
            # The route sent this decode step to the layers: their linears go to torch's
            # GEMMs (the point of the route), timed against the program's steps.
            assert self.native is not None
            timed, gemms = self._routed(num_tokens), self.native.torch_gemms()
            with timed, gemms, self._torch_threads(num_tokens):
                yield
            return
        with self._torch_threads(num_tokens):
            yield

    @contextlib.contextmanager
    def _torch_threads(self, num_tokens: int) -> Iterator[None]:
        if num_tokens > LONG_STEP_TOKENS and self.native is not None:
            # A long step (a prefill chunk, a vision tower over a video) is too dear to try
            # both ways: one trial on one thread costs seconds on a quiet machine (a 2k-token
            # video prefill: 2x). The decode steps' cheap trials already tell whether another
            # program holds a core; follow them.
            alone = self.native.step_threads.prefers_alone
            with torch_intra_op_threads(1 if alone else self.torch_threads.threads):
                yield
            return
        threads = self.torch_threads.choose(num_tokens)
        start = time.perf_counter_ns()
        try:
            with torch_intra_op_threads(threads):
                yield
        finally:
            self.torch_threads.record(num_tokens, time.perf_counter_ns() - start)

    def prepare_model(self, model: nn.Module) -> None:
        if self.dtype == torch.bfloat16 and not has_native_bf16_matmul():
            most = attach_fp32_gemm_weights(model, FP32_GEMM_MIN_ROWS, self.fp32_copy_budget)
            limit = self.fp32_copy_budget.left
            logger.info(
                "CPU without native bf16 matmul: fp32 weight copies for batched GEMMs, made on "
                "first use (up to %.0f MiB%s)",
                most / 2**20,
                "" if limit is None else f", budget {limit / 2**20:.0f} MiB",
            )
        elif self.dtype == torch.bfloat16 and packed_gemm_supported(self.dtype):
            most = attach_packed_gemm_weights(
                model, PACKED_GEMM_MIN_ROWS, PACKED_GEMM_MAX_ROWS, self.fp32_copy_budget
            )
            logger.debug("oneDNN-prepacked bf16 weight copies: up to %.0f MiB", most / 2**20)
        if self.native is not None:
            attach_native_ops(model, self.native)

    def attention_backend(self, requested: str | None) -> AttentionBackend:
        if self.native is not None and requested is None:
            return NativeCpuAttentionBackend(self.native)
        return super().attention_backend(requested)

    def decode_program(self, model: nn.Module) -> LlamaDecodeProgram | None:
        build_plan = getattr(model, "native_decode_plan", None)
        if self.native is None or build_plan is None:
            return None
        plan = build_plan()
        program = None if plan is None else LlamaDecodeProgram.build(plan, self.native)
        if program is not None and program.bf16_linears and has_native_bf16_matmul():
            self.decode_route = DecodeRoute()
        return program
