"""The native library's ABI, declared once: every exported function's ctypes signature, the
decode program's struct layouts, the dtype / weight format codes and status codes.

The C++ sources (cpu_kernels.cpp, row_kernels.cpp, quant_kernels.cpp, llama_decode.cpp,
thread_pool.cpp, common.h) are the other half of this table; `ABI_VERSION` equals
`TV_ABI_VERSION` in common.h and is compiled into the library (`tv_abi_version()`), so a library
built from other sources is caught at load (see build.py). Change both sides and bump both
numbers together; tests/test_native_abi.py checks that the exports, the version and the struct
fields agree.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from ctypes import POINTER, Structure, c_float, c_int, c_int64, c_void_p
from types import MappingProxyType
from typing import Any

import torch

ABI_VERSION = 14

# Dtype codes of activations, dense weights, biases and caches (common.h `load` / `store`);
# they double as the weight format codes of dense rows.
FORMAT_F32 = 0
FORMAT_BF16 = 1
# GGUF block matrices kept exactly as the file stores them (quant_kernels.cpp).
FORMAT_Q4_0 = 2
FORMAT_Q4_1 = 3
FORMAT_Q8_0 = 4
FORMAT_Q4_K = 5
FORMAT_Q6_K = 6
FORMAT_Q5_0 = 7

# Or-ed into a Q4_0 / Q4_1 / Q8_0 code: GEMVs round their activations to int8 per block of 32
# (int8_kernels.cpp, int8_rows16*.cpp, opt-in `int8_activations`; not exact) where a kernel
# covers the CPU and layout (the file's: AVX512-VNNI; the 16-row one: AVX512-VNNI or AVX2).
FORMAT_INT8_ACT = 0x100
# Or-ed into a Q4_0 / Q4_1 / Q8_0 code: the matrix is repacked 16 rows at a time
# (rows16_layout.cpp, `tv_repack_rows16`) for the int8-activation GEMVs or the exact bf16 ones;
# dequantizing and embedding lookups read it as well.
FORMAT_ROWS16 = 0x200

DTYPE_CODES: Mapping[torch.dtype, int] = MappingProxyType(
    {torch.float32: FORMAT_F32, torch.bfloat16: FORMAT_BF16}
)
# ggml type id -> format code, for the block types the kernels read.
GGUF_FORMATS: Mapping[int, int] = MappingProxyType(
    {
        2: FORMAT_Q4_0,
        3: FORMAT_Q4_1,
        6: FORMAT_Q5_0,
        8: FORMAT_Q8_0,
        12: FORMAT_Q4_K,
        14: FORMAT_Q6_K,
    }
)

# Query heads per KV head up to which the native attention runs (NativeCpuAttentionBackend and
# the decode program send larger groups elsewhere).
MAX_QUERIES_PER_KV = 64

# TvModel.act: the MLP's gate activation.
ACT_SILU = 0
ACT_GELU_TANH = 1

# TvLayer.kind: the layer's mixer (llama_decode.cpp kLayerShortConv).
LAYER_ATTENTION = 0
LAYER_SHORT_CONV = 1

# What the functions returning int report (llama_decode.cpp kOk / kErrWorkspace /
# kErrNoStateSlots).
STATUS_OK = 0
STATUS_WORKSPACE_TOO_SMALL = 1
STATUS_NO_STATE_SLOTS = 2


class TvLayer(Structure):
    """struct TvLayer (llama_decode.cpp): one decoder layer's tensors and weight formats."""

    _fields_ = [
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
        ("pre_ff_norm", c_void_p),
        ("post_ff_norm", c_void_p),
        ("cos_c", c_void_p),
        ("sin_c", c_void_p),
        ("kind", c_int),
        ("conv_k", c_int64),
        ("conv_w", c_void_p),
        ("conv_b", c_void_p),
        ("conv_state", c_void_p),
    ]


class TvModel(Structure):
    """struct TvModel (llama_decode.cpp): the model's shapes, shared tensors, layers and the
    per-step workspace the program owns."""

    _fields_ = [
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
        ("layers", POINTER(TvLayer)),
        ("embed_fmt", c_int),
        ("act", c_int),
        ("embed_scale", c_float),
        ("workspace", c_void_p),
        ("workspace_bytes", c_int64),
    ]


_P, _I, _L, _F = c_void_p, c_int, c_int64, c_float
_LINEAR = (_P, _I, _P, _I, _P, _I, _P, _I, _L, _L, _I)

# name -> (restype, argtypes), in the order of the C parameter lists.
FUNCTIONS: Mapping[str, tuple[Any, tuple[Any, ...]]] = MappingProxyType(
    {
        # common.h / llama_decode.cpp
        "tv_abi_version": (c_int, ()),
        # cpu_kernels.cpp
        "tv_linear": (None, _LINEAR),
        "tv_rms_norm": (None, (_P, _P, _P, _P, _I, _L, _L, _F)),
        "tv_silu_mul": (None, (_P, _P, _I, _L, _L)),
        "tv_gelu_tanh_mul": (None, (_P, _P, _I, _L, _L)),
        "tv_rope": (None, (_P, _L, _L, _P, _L, _L, _I, _L, _L, _L, _P, _P, _P)),
        "tv_store_kv": (None, (_P, _L, _P, _L, _L, _L, _I, _P, _P, _P)),
        "tv_paged_decode": (
            None,
            (_P, _L, _P, _I, _L, _P, _P, _P, _P, _P, _L, _P, _L, _L, _L, _L, _L, _F, _L, _F, _I),
        ),
        # row_kernels.cpp
        "tv_rows_supported": (c_int, ()),
        "tv_rows_bf16_hw": (c_int, ()),
        "tv_rows_round_bf16": (None, (_P, _P, _L, _I)),
        "tv_rows_rms_norm": (None, (_P, _P, _P, _P, _I, _L, _L, _F, _I, _P)),
        "tv_rows_silu_mul": (None, (_P, _P, _I, _L, _L, _I, _P)),
        "tv_rows_silu_mul_bf16_in_f32": (None, (_P, _P, _L, _L, _I, _P)),
        "tv_rows_store_kv": (None, (_P, _L, _P, _L, _L, _L, _I, _P, _P, _P, _I, _P)),
        "tv_rows_rope": (None, (_P, _L, _L, _P, _L, _L, _I, _L, _L, _L, _P, _P, _P, _I, _P)),
        # quant_kernels.cpp
        "tv_linear_blocks": (None, _LINEAR),
        "tv_linear_any": (None, _LINEAR),
        "tv_dequant_rows": (None, (_P, _I, _L, _L, _L, _P, _I)),
        "tv_embedding_any": (None, (_P, _I, _P, _L, _L, _P, _I)),
        # llama_decode.cpp
        "tv_head_norm": (None, (_P, _L, _L, _L, _P, _I, _L, _F)),
        "tv_llama_workspace_bytes": (c_int64, (POINTER(TvModel), _L)),
        "tv_llama_decode": (c_int, (POINTER(TvModel), _L, _L, _P, _P, _P, _P, _P, _L, _P, _P, _P)),
        # thread_pool.cpp
        "tv_pool_stats": (None, (_P,)),
        "tv_pool_govern": (None, (_I,)),
        # avx512_kernels.cpp
        "tv_set_isa": (c_int, (_I,)),
        # int8_kernels.cpp
        "tv_int8_act_supported": (c_int, (_I,)),
        # int8_rows16.cpp
        "tv_rows16_supported": (c_int, (_I,)),
        "tv_repack_rows16": (None, (_P, _I, _L, _L, _P, _I)),
        # bf16_pairs.cpp
        "tv_bf16_pairs_supported": (c_int, ()),
        "tv_repack_bf16_pairs": (None, (_P, _L, _L, _P, _I)),
        # bf16_rows16.cpp
        "tv_rows16_exact_supported": (c_int, (_I,)),
        # amx_linear.cpp
        "tv_amx_supported": (c_int, ()),
        # prefill_attn_amx.cpp
        "tv_prefill_attn_amx": (
            None,
            (_P, _P, _P, _P, _L, _P, _P, _P, _P, _L, _P, _P, _L, _L, _L, _L, _L, _L, _F, _I, _P),
        ),
        # prefill_attn_avx2.cpp
        "tv_prefill_attn_f32": (
            None,
            (
                _P,
                _P,
                _P,
                _P,
                _I,
                _L,
                _P,
                _P,
                _P,
                _P,
                _L,
                _P,
                _P,
                _L,
                _L,
                _L,
                _L,
                _L,
                _L,
                _L,
                _F,
                _I,
                _P,
            ),
        ),
        # attn_amx.cpp
        "tv_set_decode_amx": (c_int, (_I,)),
        "tv_decode_amx_calls": (c_int64, ()),
    }
)


def missing_functions(lib: ctypes.CDLL) -> list[str]:
    """The functions of `FUNCTIONS` that `lib` does not export."""
    return [name for name in FUNCTIONS if not hasattr(lib, name)]


def bind(lib: ctypes.CDLL) -> None:
    """Give every function of `lib` its declared signature (once, when the library loads)."""
    for name, (restype, argtypes) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = list(argtypes)


def format_code(dtype: torch.dtype) -> int | None:
    """The code of `dtype` (None: the kernels cannot read it)."""
    return DTYPE_CODES.get(dtype)
