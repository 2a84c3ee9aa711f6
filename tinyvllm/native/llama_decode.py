"""A whole Llama-family decode step as one native call (see `tv_llama_decode`).

`LlamaDecodeProgram` binds every tensor of a model's `DecodePlan` (which the model builds,
see tinyvllm/native/decode_plan.py) once; a batch of up to `max_linear_rows` tokens then runs
embedding -> layers -> final norm without returning to Python. Weights are float rows (bf16
ones perhaps repacked, see `build`) or GGUF blocks (format codes of abi.py). Plans the kernels
cannot run (mixed dtypes, non-contiguous tensors, more than 64 query heads per KV head) get no
program and keep the module path. The step's buffers live in a workspace the program owns:
allocated once, grown with the batch, never allocated by the step itself.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tinyvllm.native.abi import (
    ACT_GELU_TANH,
    ACT_SILU,
    FORMAT_BF16,
    FORMAT_ROWS16,
    LAYER_ATTENTION,
    LAYER_SHORT_CONV,
    MAX_QUERIES_PER_KV,
    STATUS_NO_STATE_SLOTS,
    STATUS_OK,
    STATUS_WORKSPACE_TOO_SMALL,
    TvLayer,
    TvModel,
    format_code,
)
from tinyvllm.native.decode_plan import DecodeLayerPlan, DecodePlan, NativeMatrix
from tinyvllm.native.ops import NativeCpuOps, max_linear_rows
from tinyvllm.native.pair_copies import FORMAT_PAIRS, PAIRS_MIN_REQUESTS, PairCopies
from tinyvllm.native.pair_copies import LINEARS as PAIR_LINEARS

if TYPE_CHECKING:
    from tinyvllm.attention.recurrent import RecurrentMetadata

_ACTIVATIONS = {"silu": ACT_SILU, "gelu_tanh": ACT_GELU_TANH}
# Tokens a step may have for the program when every linear is in the bf16 pair layout: its GEMM
# runs ~230 GFLOP/s on 2 Ice Lake cores there, near MKL's on the fp32 copies, without the
# layers' per-op cost. The 64-request mix (throughput.py (d)) ran 315-325 tok/s with 128,
# 298-309 with 64 (max_linear_rows) and 289-300 with 256 (the program's per-token attention
# then takes prefill chunks the layers' prefill kernel does better).
MAX_PAIRS_ROWS = 128
_STATUS = {
    STATUS_WORKSPACE_TOO_SMALL: "workspace too small",
    STATUS_NO_STATE_SLOTS: "a short-conv model got no state slots",
}


class _Unsupported(Exception):
    pass


class _Binder:
    """Turns a plan's tensors into pointers, checking what the kernels assume, and keeps the
    tensors alive for as long as the program points into them."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.keep: list[torch.Tensor] = []

    def tensor(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> int | None:
        """A tensor in the plan's dtype (or `dtype`: float32 for the rope tables)."""
        if t is None:
            return None
        if t.dtype != (dtype or self.dtype) or not t.is_contiguous() or t.device.type != "cpu":
            raise _Unsupported
        self.keep.append(t)
        return t.data_ptr()

    def matrix(self, m: NativeMatrix) -> tuple[int, int]:
        """(pointer, format code) of a weight; its bias goes through `tensor`."""
        dense = m.fmt <= FORMAT_BF16
        if not m.data.is_contiguous() or m.data.device.type != "cpu":
            raise _Unsupported
        if dense and m.data.dtype != self.dtype:
            raise _Unsupported
        self.keep.append(m.data)
        return m.data.data_ptr(), m.fmt

    def layer(self, plan: DecodeLayerPlan) -> TvLayer:
        qkv, o = self.matrix(plan.qkv), self.matrix(plan.o)
        gate_up, down = self.matrix(plan.gate_up), self.matrix(plan.down)
        conv = plan.short_conv
        return TvLayer(
            self.tensor(plan.input_norm),
            self.tensor(plan.post_attention_norm),
            qkv[0],
            self.tensor(plan.qkv.bias),
            o[0],
            self.tensor(plan.o.bias),
            gate_up[0],
            self.tensor(plan.gate_up.bias),
            down[0],
            self.tensor(plan.down.bias),
            self.tensor(plan.q_norm),
            self.tensor(plan.k_norm),
            self.tensor(plan.kv_cache),
            plan.sliding_window,
            qkv[1],
            o[1],
            gate_up[1],
            down[1],
            self.tensor(plan.pre_feedforward_norm),
            self.tensor(plan.post_feedforward_norm),
            self.tensor(plan.cos_cache, torch.float32),
            self.tensor(plan.sin_cache, torch.float32),
            LAYER_ATTENTION if conv is None else LAYER_SHORT_CONV,
            0 if conv is None else conv.weight.shape[1],
            None if conv is None else self.tensor(conv.weight),
            None if conv is None else self.tensor(conv.bias),
            None if conv is None else self.tensor(conv.state),
        )

    def model(self, plan: DecodePlan, dt: int, num_threads: int, layers: ctypes.Array) -> TvModel:
        kv = next(layer.kv_cache for layer in plan.layers if layer.kv_cache is not None)
        embed_ptr, embed_fmt = self.matrix(plan.embed)
        return TvModel(
            dt,
            num_threads,
            len(plan.layers),
            plan.final_norm.shape[0],
            plan.num_heads,
            plan.num_kv_heads,
            plan.head_dim,
            plan.rotary_dim,
            plan.intermediate_size,
            kv.shape[1],
            kv.shape[2],
            plan.eps,
            plan.scale,
            embed_ptr,
            self.tensor(plan.final_norm),
            self.tensor(plan.cos_cache, torch.float32),
            self.tensor(plan.sin_cache, torch.float32),
            layers,
            embed_fmt,
            _ACTIVATIONS[plan.activation],
            plan.embed_scale,
            None,
            0,
        )


class LlamaDecodeProgram:
    def __init__(
        self,
        ops: NativeCpuOps,
        model: TvModel,
        layers: ctypes.Array,
        keep: list,
        pairs: PairCopies | None = None,
    ):
        self.ops = ops
        self._model = model
        self._model_ref = ctypes.byref(model)  # made once: the step passes it every call
        self._layers = layers
        self._keep = keep  # tensors whose memory the program points into
        self.hidden_size = int(model.hidden)
        self.dtype = torch.float32 if model.dt == 0 else torch.bfloat16
        self._fn = ops.lib.tv_llama_decode
        # Short-conv layers (LFM2) need each request's state slot every step.
        self.needs_state_slots = any(layer.kind == LAYER_SHORT_CONV for layer in layers)
        # Every linear a bf16 matrix: the layers can run the same step on torch's bf16 GEMMs
        # (see decode_route.py); GGUF blocks and fp32 weights stay on the program.
        self.bf16_linears = all(fmt & ~FORMAT_ROWS16 == FORMAT_BF16 for fmt in self._codes())
        self._pairs = pairs if pairs is not None and pairs.pending else None
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._workspace_rows = 0
        self._set_max_rows()

    def _codes(self) -> list[int]:
        return [getattr(layer, f"{name}_fmt") for layer in self._layers for name in PAIR_LINEARS]

    def _set_max_rows(self) -> None:
        pairs = all(fmt == FORMAT_PAIRS for fmt in self._codes())
        self.max_rows = MAX_PAIRS_ROWS if pairs else max_linear_rows(self.dtype)
        if self.max_rows > self._workspace_rows:
            self._grow_workspace(self.max_rows)

    @classmethod
    def build(
        cls,
        plan: DecodePlan,
        ops: NativeCpuOps,
        take_copy_bytes: Callable[[int], bool] | None = None,
    ) -> LlamaDecodeProgram | None:
        """The program for a model's plan (KV caches bound), or None when the kernels cannot
        run it.

        On CPUs whose best GEMM reads bf16 weights in the pair layout the program makes its
        own repacked copy of each bf16 linear at its first step of `PAIRS_MIN_REQUESTS`
        requests, as far as `take_copy_bytes` (the platform's weight-copy budget; None: no
        limit) grants their bytes (pair_copies.py); other weights stay in place."""
        dt = format_code(plan.dtype)
        if dt is None or plan.num_heads // plan.num_kv_heads > MAX_QUERIES_PER_KV:
            return None
        caches = [layer.kv_cache for layer in plan.layers if layer.short_conv is None]
        if not caches or any(kv is None or kv.dtype != plan.dtype for kv in caches):
            return None
        if plan.activation not in _ACTIVATIONS:
            return None
        tables = [t for layer in plan.layers for t in (layer.cos_cache, layer.sin_cache)]
        if any(t is not None and t.shape != plan.cos_cache.shape for t in tables):
            return None  # every rope table must cover the same positions and rotary dims
        binder = _Binder(plan.dtype)
        try:
            layers = (TvLayer * len(plan.layers))(*map(binder.layer, plan.layers))
            model = binder.model(plan, dt, ops.num_threads, layers)
        except _Unsupported:
            return None
        pairs = PairCopies(ops, take_copy_bytes)
        for layer, layer_plan in zip(layers, plan.layers, strict=True):
            for name in PAIR_LINEARS:
                pairs.note(layer, name, getattr(layer_plan, name).data)
        return cls(ops, model, layers, binder.keep, pairs)

    def _grow_workspace(self, rows: int) -> None:
        """Room for steps of up to `rows` tokens (the program's one allocation)."""
        size = int(self.ops.lib.tv_llama_workspace_bytes(ctypes.byref(self._model), rows))
        self._workspace = torch.empty(size, dtype=torch.uint8)
        self._workspace_rows = rows
        self._model.workspace = self._workspace.data_ptr()
        self._model.workspace_bytes = size

    def supports(self, num_tokens: int) -> bool:
        """Batches of up to `max_rows` tokens: decode, K + 1 verify, short prefill chunks
        (longer ones are GEMM work that torch's batched kernels do better)."""
        return 0 < num_tokens <= self.max_rows

    def _make_pairs(self) -> None:
        """The pair copies, once (then `max_rows` may grow)."""
        assert self._pairs is not None
        self._pairs.make()
        self._keep.extend(self._pairs.keep)
        self._pairs = None
        self._set_max_rows()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_table: torch.Tensor,
        recurrent: RecurrentMetadata | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of every scheduled token; a model with short-conv
        layers reads and writes each request's state slot of `recurrent`."""
        t = input_ids.shape[0]
        if self._pairs is not None and query_start_loc.shape[0] - 1 >= PAIRS_MIN_REQUESTS:
            self._make_pairs()  # the first batch of requests: the copies pay from now on
        if t > self._workspace_rows:
            self._grow_workspace(t)
        out = torch.empty((t, self.hidden_size), dtype=self.dtype)
        slots = initial = None
        if recurrent is not None:
            slots = recurrent.state_indices.data_ptr()
            initial = recurrent.has_initial_state.data_ptr()
        status = self._fn(
            self._model_ref, t, query_start_loc.shape[0] - 1, input_ids.data_ptr(),
            positions.data_ptr(), slot_mapping.data_ptr(), query_start_loc.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), slots, initial, out.data_ptr(),
        )  # fmt: skip
        if status != STATUS_OK:
            what = _STATUS.get(status, "error")
            raise RuntimeError(
                f"tv_llama_decode failed with status {status} ({what}) on a {t}-token step"
            )
        return out
