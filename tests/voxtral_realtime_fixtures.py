"""A tiny random Voxtral Realtime checkpoint (the real config's shape at small sizes: 2-layer
causal audio encoder over 16 mel bins with a 12-frame attention window, 2-layer Mistral
decoder with time conditioning) plus the suite's tokenizer, and HF references."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

MEL_BINS = 16
# The streaming prefix a real prompt has ([BOS] + streaming pad tokens); any ids work here.
PROMPT = [1, 5, 7, 9]


def build_tiny_voxtral(
    out_dir: Path, tokenizer_dir: Path, seed: int = 0, encoder_window: int = 12
) -> Path:
    """Save a random float32 VoxtralRealtimeForConditionalGeneration plus tokenizer."""
    from transformers import (
        AutoTokenizer,
        VoxtralRealtimeConfig,
        VoxtralRealtimeForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "sliding_window": 64, "max_position_embeddings": 1024,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id}  # fmt: skip
    audio = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "head_dim": 16, "num_mel_bins": MEL_BINS,
             "sliding_window": encoder_window, "max_position_embeddings": 4096}  # fmt: skip
    config = VoxtralRealtimeConfig(text_config=text, audio_config=audio)
    model = VoxtralRealtimeForConditionalGeneration(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:  # small: tied, a large row would repeat its own token
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "norm" in name and "ada" not in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    preprocessor = {"feature_extractor_type": "VoxtralRealtimeFeatureExtractor",
                    "feature_size": MEL_BINS, "sampling_rate": 16000, "hop_length": 160,
                    "n_fft": 400, "win_length": 400, "global_log_mel_max": 1.5}  # fmt: skip
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return out_dir


def make_llm(path: Path, **kwargs: Any) -> Any:
    """Our engine on the checkpoint: float32, eager, a small KV cache."""
    from tinyvllm import LLM

    options = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True,
               "kv_cache_memory_bytes": 2**22, "seed": 0}  # fmt: skip
    return LLM(str(path), **(options | kwargs))


def hf_model(path: Path) -> Any:
    from transformers import VoxtralRealtimeForConditionalGeneration

    return VoxtralRealtimeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_features(samples: np.ndarray) -> torch.Tensor:
    """[1, mel_bins, frames]: transformers' feature extractor on the whole audio."""
    from transformers import VoxtralRealtimeFeatureExtractor

    fe = VoxtralRealtimeFeatureExtractor(feature_size=MEL_BINS)
    return fe(samples, sampling_rate=16000, return_tensors="pt").input_features


def random_audio(seconds: float, seed: int) -> np.ndarray:
    """float32 16 kHz audio of 40 ms segments, each a tone plus noise at one of three levels
    (near silence to loud): positions hear different things, so a random model's greedy
    tokens vary instead of repeating one token."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    out = np.zeros(n, dtype=np.float32)
    for start in range(0, n, 640):
        t = np.arange(min(640, n - start)) / 16000
        amp = rng.choice([0.0005, 0.05, 0.5])
        tone = np.sin(2 * np.pi * rng.uniform(80, 7000) * t)
        out[start : start + t.size] = amp * (tone + 0.3 * rng.standard_normal(t.size))
    return out


@torch.no_grad()
def hf_reference(
    hf: Any, prompt: list[int], samples: np.ndarray, max_new_tokens: int | None = None
) -> tuple[list[int], torch.Tensor]:
    """HF generate's greedy output tokens, and the full forward's per-position log-softmax
    over prompt + output (every position with its audio)."""
    feats = hf_features(samples)
    ids = torch.tensor([prompt])
    kwargs: dict[str, Any] = {"num_delay_tokens": hf.config.default_num_delay_tokens}
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    out = hf.generate(input_ids=ids, input_features=feats, do_sample=False, **kwargs)
    tokens = out[0, len(prompt) :].tolist()
    full = out[:, :-1] if tokens else out
    frames = full.shape[1] * hf.config.audio_length_per_tok
    logits = hf(
        input_ids=full,
        input_features=feats[..., :frames],
        num_delay_tokens=hf.config.default_num_delay_tokens,
    ).logits[0]
    return tokens, logits.float().log_softmax(-1)
