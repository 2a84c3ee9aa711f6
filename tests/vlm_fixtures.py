"""A tiny random Qwen2.5-VL checkpoint (vision depth 2, small Qwen2 LM) and HF references.

The tokenizer is the suite's trained BPE tokenizer plus Qwen's vision special tokens, so text
prompts can hold `<|vision_start|><|image_pad|><|vision_end|>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PROMPT = "Look: <|vision_start|><|image_pad|><|vision_end|> describe it"
VIDEO_PROMPT = "Watch <|vision_start|><|video_pad|><|vision_end|> and tell"
# Patch 14, merge 2: sides that are multiples of 28 are used as they are (no resize).
PATCH, MERGE = 14, 2


def build_tiny_vlm(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random float32 Qwen2.5-VL checkpoint plus tokenizer to `out_dir`."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        # 16-dim heads: 8 rotary frequencies in (time, height, width) sections.
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                            "rope_theta": 10000.0},
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }  # fmt: skip
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 56,  # two merged tokens: windowed blocks see several windows
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
        tie_word_embeddings=False,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif "norm" in name or "ln_q" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def hf_model(path: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def random_image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def moving_clip(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """A static random background with a bright square moving across it."""
    background = random_image(height, width, seed)
    clip = np.repeat(background[None], frames, axis=0)
    for t in range(frames):
        x = (t * 11) % max(1, width - 20)
        clip[t, 4:24, x : x + 20] = 255
    return clip
