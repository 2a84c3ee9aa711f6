"""What differs per device, chosen once when the runner starts (vLLM's `vllm/platforms/`).

A `Platform` decides which kernels a model is built and run with: the quantized weights'
block kernels, layer-level native ops, the attention backend, a whole-step program (the
native decode program on CPU) and whether CUDA graphs are captured. The runner asks it once
and never branches on the device or on `enforce_eager` itself. This base class is the plain
PyTorch path: torch ops only, no native library loaded, no graphs (what `enforce_eager=True`
gives on any device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionBackend, get_attention_backend
from tinyvllm.native.quant_ops import QuantKernels

if TYPE_CHECKING:
    # The one whole-step program today; a second one would share its supports / run.
    from tinyvllm.native.llama_decode import LlamaDecodeProgram as DecodeProgram


class Platform:
    """The plain PyTorch path on `device`; subclasses override what their device adds."""

    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    @property
    def quant_kernels(self) -> QuantKernels | None:
        """Native block kernels for quantized weights (handed to `load_model`); None keeps
        GGUF blocks on torch's kernels."""
        return None

    @property
    def uses_cuda_graphs(self) -> bool:
        return False

    @property
    def native_layer_ops(self) -> bool:
        """Whether layers run native kernels on their own thread pool (then a decode-sized
        step keeps torch single-threaded, so its OpenMP workers do not compete)."""
        return False

    def start_step(self, num_tokens: int, native: bool) -> None:
        """Called before a step of `num_tokens` tokens; `native` when it is decode-sized and
        runs on native kernels (their thread count chosen per step where the platform has
        them), else its heavy work runs on torch ops (prefill on CPU: torch's thread count
        chosen per step there). A pair of calls, not a context manager: on the decode path
        each step pays for every frame it runs, with the caches cold after the weights
        streamed through them."""

    def finish_step(self) -> None:
        """Called after the step `start_step` began, also when it raised."""

    def hand_over_steps(self) -> None:
        """Called in the thread that built the engine when another thread is to run its
        steps (AsyncLLM's engine thread): frees what the builder's thread holds for steps of
        its own (on CPU, torch's idle OpenMP workers)."""

    def steps_in_a_row(self) -> AbstractContextManager[None]:
        """Wraps steps run back to back (LLM.generate's loop): state a step sets for itself
        (torch's thread count on CPU) may stay between them, restored when the block ends."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def stepping(self, num_tokens: int, native: bool) -> Iterator[None]:
        """`start_step` / `finish_step` around a block (for callers off the hot path)."""
        self.start_step(num_tokens, native)
        try:
            yield
        finally:
            self.finish_step()

    def native_step(self, num_tokens: int) -> AbstractContextManager[None]:
        return self.stepping(num_tokens, True)

    def torch_step(self, num_tokens: int) -> AbstractContextManager[None]:
        return self.stepping(num_tokens, False)

    def routes_to_program(self, num_tokens: int) -> bool:
        """Whether a step the decode program supports runs on it rather than on the model's
        layers (asked once per such step, before `start_step`)."""
        return True

    def prepare_model(self, model: nn.Module) -> None:
        """Give a loaded model (target or draft) what this platform runs it with."""

    def attention_backend(self, requested: str | None) -> AttentionBackend:
        """The backend for `requested` ("torch" | "triton", None: the device's default)."""
        return get_attention_backend(self.device, requested)

    def decode_program(self, model: nn.Module) -> DecodeProgram | None:
        """A whole-step program for `model` (after its KV caches are bound), or None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"
