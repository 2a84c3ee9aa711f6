"""A tiny random-weight LFM2 checkpoint (hybrid: short-conv + attention layers), built with
HF transformers so that parity tests compare against HF on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fixtures import _randomize, save_with_tokenizer

# Attention at layers 2 and 4 (not first or last), conv everywhere else; the feed-forward
# width goes through HF's auto adjustment (200 -> 133 -> rounded up to 160).
TINY_LFM2: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 200,
    "block_auto_adjust_ff_dim": True,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 32,
    "num_hidden_layers": 6,
    "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "conv_L_cache": 3,
    "conv_bias": False,
    "norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
}


def build_tiny_lfm2(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Lfm2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    kwargs = {
        **TINY_LFM2,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **overrides,
    }
    config = Lfm2Config(**kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, std=0.3)
    return save_with_tokenizer(model, out_dir, tokenizer_dir)
