"""What a hub download fetches, shared by the catalog's downloader and the model loader (which
imports torch; the catalog must not)."""

from __future__ import annotations

# Config, safetensors weights and tokenizer files, never pickled .bin/.pt weights or other
# formats the repo may also carry.
HUB_ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    # Vision-language models: image / video preprocessing parameters.
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    # sentence-transformers: how an embedding model pools (modules.json, 1_Pooling/...).
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "*_Pooling/config.json",
    "vocab.txt",
)
