"""GGUF tensors -> (HF parameter name, tensor) pairs that our models' `load_weights` takes.

llama.cpp renames tensors (`blk.N.attn_q.weight`) and, for the llama architecture only,
reorders the rows of q/k so that each head's rotary pairs are interleaved (GPT-J layout)
instead of split in halves (HF's neox layout). Undoing that is a pure row permutation,
so it applies to quantized rows as well as to dequantized ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from tinyvllm.gguf.config import check_architecture
from tinyvllm.gguf.dequant import dequantize, is_supported, qtype_name
from tinyvllm.gguf.reader import GGUFFile
from tinyvllm.gguf.weight import GGUFWeight

_GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
)
_LAYER_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
# Where an architecture's layer tensors differ: Gemma 3 normalises before and after both
# attention and MLP, and llama.cpp's `ffn_norm` is its pre-MLP norm.
_ARCH_LAYER_TENSORS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "gemma3": MappingProxyType(
            {
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            }
        )
    }
)
# llama.cpp's converter stores Gemma's (1 + w) norm scales with the 1 added; HF names carry
# HF's values, so the 1 comes off again (the model adds it back at load).
_NORM_OFFSET_ARCHITECTURES = frozenset({"gemma3"})
# Folded into the config (Llama 3 rope scaling), not a parameter.
_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
# ggml type ids stored as plain floats.
_FLOAT_TYPES: Mapping[int, torch.dtype] = MappingProxyType(
    {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
)
_PERMUTED_ARCHITECTURES = frozenset({"llama"})


def hf_tensor_name(name: str, architecture: str = "llama") -> str | None:
    """The HF checkpoint name of a GGUF tensor name of a file of `architecture`, or None if
    it is not a model tensor."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    layer_tensors = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(architecture, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    return None


def unpermute_rows(num_heads: int, rows: int) -> torch.Tensor:
    """Row index turning llama.cpp's per-head interleaved q/k rows back into HF order:
    `hf = gguf[index]`. Within a head, GGUF row 2*i + j holds HF row j * head_dim/2 + i."""
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} q/k rows do not split into {num_heads} heads of even size")
    return torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def _permutation_heads(gf: GGUFFile, hf_config: Any, name: str) -> int | None:
    if gf.architecture not in _PERMUTED_ARCHITECTURES:
        return None
    if ".attn_q." in name:
        return int(hf_config.num_attention_heads)
    if ".attn_k." in name:
        return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    return None


def iter_gguf_weights(
    gf: GGUFFile,
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Yield `(hf_name, value)` for every model tensor of `gf`, one at a time.

    Float tensors (F32/F16/BF16) and 1-D tensors come as plain tensors in the file's dtype
    (the parameter copy casts them). Block-quantized 2-D tensors are dequantized on
    `device` to `dtype`, or, with `keep_quantized`, yielded as `GGUFWeight` (raw bytes on
    `device`, rows already in HF order) for layers that compute on the blocks.
    Raises ValueError naming the tensor for unsupported types and unknown tensor names.
    """
    check_architecture(gf)
    for name, info in gf.tensors.items():
        if name in _CONFIG_TENSORS:
            continue
        hf_name = hf_tensor_name(name, gf.architecture)
        if hf_name is None:
            raise ValueError(
                f"GGUF tensor {name!r} has no counterpart in {gf.architecture} models "
                "(is the file for a different architecture?)"
            )
        if not is_supported(info.qtype):
            raise ValueError(
                f"GGUF tensor {name!r} has type {qtype_name(info.qtype)}, which is not "
                "supported; use a GGUF with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K-Q6_K, F16 or BF16 "
                "weights"
            )
        heads = _permutation_heads(gf, hf_config, name)
        index = None if heads is None else unpermute_rows(heads, info.shape[0]).to(device)
        if len(info.shape) == 2 and keep_quantized and info.qtype not in _FLOAT_TYPES:
            # Blocks the layer keeps: read into memory of their own, which it can keep as is.
            raw = gf.read(name).to(device)
            shape = (info.shape[0], info.shape[1])
            weight = GGUFWeight(raw, info.qtype, shape, owned=True)
            yield hf_name, weight if index is None else weight.select_rows(index)
            continue
        raw = gf.raw(name).to(device)
        if info.qtype in _FLOAT_TYPES:
            tensor = raw.view(_FLOAT_TYPES[info.qtype]).view(info.shape)
            if gf.architecture in _NORM_OFFSET_ARCHITECTURES and name.endswith("norm.weight"):
                tensor = tensor.float() - 1.0
        else:
            tensor = dequantize(raw, info.qtype, info.shape).to(dtype)
        yield hf_name, tensor if index is None else tensor[index]
        gf.release(name)  # the model copied it
