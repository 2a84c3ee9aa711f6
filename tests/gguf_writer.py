"""Write a tiny HF checkpoint (from `fixtures.build_tiny_checkpoint`) as a GGUF file the way
llama.cpp's converter does: renamed tensors, llama q/k rows permuted, block-quantized 2-D
weights, F32 norms, the byte-level BPE vocabulary and chat template as metadata.

Written independently of `tinyvllm.gguf` (its own name table and permutation), so loading
the result through tinyvllm checks our mapping rather than repeating it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

F32 = gguf.GGMLQuantizationType.F32

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3's four norms per layer (llama.cpp calls the pre-MLP one `ffn_norm`).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    return f"blk.{layer}.{names[rest]}"


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row order: each head's two rotary halves interleaved."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tokenizer_metadata(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    data = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    specials = {t["content"] for t in data["added_tokens"] if t["special"]}
    for token in data["added_tokens"]:
        vocab[token["content"]] = token["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_token_merges(merges)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        add(vocab[config[key]])
    writer.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def _rope_metadata(writer: gguf.GGUFWriter, config: Any, head_dim: int) -> np.ndarray | None:
    """Rope metadata; for llama3 scaling the `rope_freqs` tensor llama.cpp stores instead."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params:  # Gemma 3: the global rope (the local base is llama.cpp's)
        params = dict(params["full_attention"])
    writer.add_rope_freq_base(float(params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", "default")
    if rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(params["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
    elif rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    elif rope_type == "llama3":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        base = 1.0 / (float(params["rope_theta"]) ** exponents)
        return (base / scaled).numpy().astype(np.float32)
    return None


def write_tiny_gguf(
    model_dir: Path,
    out_path: Path,
    qtype_for: Callable[[str, np.ndarray], gguf.GGMLQuantizationType] = lambda n, w: F32,
    architecture: str | None = None,
    skip: tuple[str, ...] = (),
    metadata: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
) -> Path:
    """Convert the checkpoint in `model_dir` to `out_path`. `qtype_for(gguf_name, array)`
    picks each 2-D tensor's type (1-D tensors stay F32); `skip` drops GGUF tensors;
    `metadata` sets (or overrides) keys, `{arch}.` expanded: {"{arch}.block_count": (v, type)}."""
    config = AutoConfig.from_pretrained(model_dir)
    arch = architecture or {"gemma3_text": "gemma3"}.get(config.model_type, config.model_type)
    weights = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_name("tiny test model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    rope_freqs = _rope_metadata(writer, config, head_dim)
    _tokenizer_metadata(writer, model_dir)
    for key, (value, vtype) in (metadata or {}).items():
        writer.kv_data[0].pop(key.format(arch=arch), None)
        writer.add_key_value(key.format(arch=arch), value, vtype)

    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for hf_name, tensor in weights.items():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        name = gguf_name(hf_name, arch)
        if name in skip:
            continue
        array = tensor.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter folds Gemma's (1 + w) into the file
        if arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, kv_heads)
        qtype = qtype_for(name, array) if array.ndim == 2 else F32
        if qtype == F32:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
