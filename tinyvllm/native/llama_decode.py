"""A whole Llama-family decode step as one native call (see `tv_llama_decode`).

`LlamaDecodeProgram` binds every weight, norm and KV tensor of a model once; a batch of up to
`max_linear_rows` tokens then runs embedding -> layers -> final norm without returning to
Python. Weights are float rows or GGUF blocks (format codes of quant_kernels.cpp). Models the
kernels cannot express (int4/int8 repacked weights, mixed dtypes, soft caps, non-contiguous
weights) get no program and keep the module path.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_float, c_int, c_int64, c_void_p
from typing import TYPE_CHECKING

import torch

from tinyvllm.native.ops import NativeCpuOps, dtype_code, max_linear_rows

if TYPE_CHECKING:
    from tinyvllm.models.llama import LlamaForCausalLM


class _TvLayer(Structure):
    _fields_ = [  # mirrors struct TvLayer
        ("in_norm", c_void_p),
        ("post_norm", c_void_p),
        ("qkv_w", c_void_p),
        ("qkv_b", c_void_p),
        ("o_w", c_void_p),
        ("o_b", c_void_p),
        ("gate_up_w", c_void_p),
        ("gate_up_b", c_void_p),
        ("down_w", c_void_p),
        ("down_b", c_void_p),
        ("q_norm", c_void_p),
        ("k_norm", c_void_p),
        ("kv_cache", c_void_p),
        ("window", c_int64),
        ("qkv_fmt", c_int),
        ("o_fmt", c_int),
        ("gate_up_fmt", c_int),
        ("down_fmt", c_int),
    ]


class _TvModel(Structure):
    _fields_ = [  # mirrors struct TvModel
        ("dt", c_int),
        ("nthreads", c_int),
        ("num_layers", c_int64),
        ("hidden", c_int64),
        ("hq", c_int64),
        ("hkv", c_int64),
        ("head_dim", c_int64),
        ("rot", c_int64),
        ("inter", c_int64),
        ("num_blocks", c_int64),
        ("block_size", c_int64),
        ("eps", c_float),
        ("scale", c_float),
        ("embed", c_void_p),
        ("final_norm", c_void_p),
        ("cos_c", c_void_p),
        ("sin_c", c_void_p),
        ("layers", POINTER(_TvLayer)),
        ("embed_fmt", c_int),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LlamaDecodeProgram:
    def __init__(self, ops: NativeCpuOps, model: _TvModel, layers: ctypes.Array, keep: list):
        self.ops = ops
        self._model = model
        self._layers = layers
        self._keep = keep  # tensors whose memory the program points into
        self.hidden_size = int(model.hidden)
        self.dtype = torch.float32 if model.dt == 0 else torch.bfloat16
        self.max_rows = max_linear_rows(self.dtype)
        fn = ops.lib.tv_llama_decode
        fn.argtypes = [
            POINTER(_TvModel), c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p,
            c_void_p, c_int64, c_void_p,
        ]  # fmt: skip
        fn.restype = None
        self._fn = fn

    @classmethod
    def build(cls, model: LlamaForCausalLM, ops: NativeCpuOps) -> LlamaDecodeProgram | None:
        """The program for `model` with its KV caches bound, or None when unsupported."""
        inner = model.model
        dtype = inner.norm.weight.dtype
        dt = dtype_code(dtype)
        if dt is None:
            return None
        layers = list(inner.layers)
        first = layers[0].self_attn
        rope = inner.rotary_emb
        keep: list[torch.Tensor] = []

        def tensor(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise _Unsupported
            keep.append(t)
            return t.data_ptr()

        def weight(module: torch.nn.Module) -> tuple[int, int]:
            """(pointer, format code) of a linear layer's or embedding's weight."""
            qweight = getattr(module, "qweight", None)
            if qweight is None:
                return tensor(module.weight) or 0, dt
            native = qweight.native_weight
            if native is None:
                raise _Unsupported
            fmt, data = native
            if not data.is_contiguous() or (fmt <= 1 and data.dtype != dtype):
                raise _Unsupported
            keep.append(data)
            return data.data_ptr(), fmt

        try:
            structs = (_TvLayer * len(layers))()
            for i, layer in enumerate(layers):
                attn, mlp = layer.self_attn, layer.mlp
                if attn.attn.kv_cache is None or attn.attn.logits_soft_cap:
                    raise _Unsupported
                if attn.attn.kv_cache.dtype != dtype:
                    raise _Unsupported
                qkv, o = weight(attn.qkv_proj), weight(attn.o_proj)
                gate_up, down = weight(mlp.gate_up_proj), weight(mlp.down_proj)
                structs[i] = _TvLayer(
                    tensor(layer.input_layernorm.weight),
                    tensor(layer.post_attention_layernorm.weight),
                    qkv[0],
                    tensor(attn.qkv_proj.bias),
                    o[0],
                    tensor(attn.o_proj.bias),
                    gate_up[0],
                    tensor(mlp.gate_up_proj.bias),
                    down[0],
                    tensor(mlp.down_proj.bias),
                    tensor(None if attn.q_norm is None else attn.q_norm.weight),
                    tensor(None if attn.k_norm is None else attn.k_norm.weight),
                    tensor(attn.attn.kv_cache),
                    attn.attn.sliding_window or 0,
                    qkv[1],
                    o[1],
                    gate_up[1],
                    down[1],
                )
            kv = first.attn.kv_cache
            assert kv is not None
            norm_eps = {layer.input_layernorm.eps for layer in layers}
            if len(norm_eps) != 1 or first.attn.num_heads // first.attn.num_kv_heads > 64:
                raise _Unsupported
            keep += [rope.cos_cache, rope.sin_cache]
            embed_ptr, embed_fmt = weight(inner.embed_tokens)
            desc = _TvModel(
                dt,
                ops.num_threads,
                len(layers),
                inner.norm.weight.shape[0],
                first.attn.num_heads,
                first.attn.num_kv_heads,
                first.attn.head_dim,
                rope.rotary_dim,
                mlp.down_proj.input_size,
                kv.shape[1],
                kv.shape[2],
                norm_eps.pop(),
                first.attn.scale,
                embed_ptr,
                tensor(inner.norm.weight),
                rope.cos_cache.data_ptr(),
                rope.sin_cache.data_ptr(),
                structs,
                embed_fmt,
            )
        except _Unsupported:
            return None
        return cls(ops, desc, structs, keep)

    def supports(self, num_tokens: int) -> bool:
        """Batches of up to `max_rows` tokens: decode, K + 1 verify, short prefill chunks
        (longer ones are GEMM work that torch's batched kernels do better)."""
        return 0 < num_tokens <= self.max_rows

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of every scheduled token."""
        t = input_ids.shape[0]
        out = torch.empty((t, self.hidden_size), dtype=self.dtype)
        self._fn(
            ctypes.byref(self._model), t, query_start_loc.shape[0] - 1, input_ids.data_ptr(),
            positions.data_ptr(), slot_mapping.data_ptr(), query_start_loc.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), out.data_ptr(),
        )  # fmt: skip
        return out


class _Unsupported(Exception):
    pass
