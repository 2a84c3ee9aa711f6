"""A tiny random Gemma 3 vision-language checkpoint (SigLIP depth 2, 4-layer Gemma 3 text
model) and HF references.

The tokenizer is the suite's trained BPE tokenizer plus Gemma's image tokens, so prompts can
hold `<start_of_image>` (the placeholder the chat template writes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_PROMPT = "Look: <start_of_image> describe it"
# 32 x 32 images of 8 x 8 patches (a 4 x 4 patch grid) pooled to 4 tokens (2 x 2).
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 8, 4


def build_tiny_gemma3_vlm(
    out_dir: Path, tokenizer_dir: Path, sliding_window: int, seed: int = 0
) -> Path:
    """Save a random float32 Gemma3ForConditionalGeneration plus tokenizer to `out_dir`."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE]})
    boi, eoi, image = tokenizer.convert_tokens_to_ids([BOI, EOI, IMAGE])
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "sliding_window": sliding_window,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": None,  # as the real checkpoints (HF's VLM class ignores it)
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_id=boi,
        eoi_token_id=eoi,
        image_token_id=image,
        tie_word_embeddings=True,
    )
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name or "position_embedding" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif "norm" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    preprocessor = {"image_processor_type": "Gemma3ImageProcessor", "size": size,
                    "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2,
                    "rescale_factor": 1 / 255, "do_pan_and_scan": None}  # fmt: skip
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return out_dir


def hf_model(path: Path) -> Any:
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def random_image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
