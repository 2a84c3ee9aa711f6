"""EngineArgs -> EngineConfig for a pooling model: the pooler (checkpoint, defaults, the
user's pooler_config), the context (max positions, sentence-transformers' max_seq_length) and
a batch budget that holds the longest prompt. No KV cache is sized: there is none."""

from __future__ import annotations

from typing import Any

from tinyvllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    PoolerConfig,
    SchedulerConfig,
)
from tinyvllm.engine.setup import model_config, resolved_max_num_seqs
from tinyvllm.quant.config import QuantConfig

# Tokens per step when the user sets no max_num_batched_tokens (raised to max_model_len).
DEFAULT_POOLING_BATCH_TOKENS = 8192


def build_pooling_config(
    args: EngineArgs,
    checkpoint: Any,
    dtype: str,
    device: str,
    quantization: QuantConfig | None,
) -> EngineConfig:
    from tinyvllm.models.registry import get_model_class
    from tinyvllm.models.sentence_transformers import (
        SentenceTransformersConfig,
        read_sentence_transformers_config,
    )

    if args.speculative_config is not None:
        raise ValueError("speculative_config applies to generation; a pooling model takes none")
    hf_config = checkpoint.hf_config
    st = (
        SentenceTransformersConfig()
        if checkpoint.is_gguf
        else read_sentence_transformers_config(checkpoint.path)
    )
    encoder = bool(getattr(get_model_class(hf_config), "is_encoder_only", False))
    user = PoolerConfig.from_value(args.pooler_config)
    pooler = PoolerConfig(
        pooling_type=user.pooling_type or st.pooling_type or ("CLS" if encoder else "LAST"),
        normalize=next(v for v in (user.normalize, st.normalize, True) if v is not None),
    )
    max_model_len = _pooling_max_model_len(args, hf_config, st.max_seq_length)
    max_batched = args.max_num_batched_tokens
    if max_batched is None:
        max_batched = max(DEFAULT_POOLING_BATCH_TOKENS, max_model_len)
    if max_batched < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={max_batched} is smaller than max_model_len="
            f"{max_model_len}: a pooling model runs each prompt whole in one step; raise "
            "max_num_batched_tokens or lower max_model_len"
        )
    return EngineConfig(
        model=model_config(
            args,
            checkpoint,
            dtype,
            max_model_len,
            quantization,
            runner_type="pooling",
            pooler_config=pooler,
        ),
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=resolved_max_num_seqs(args),
            max_num_batched_tokens=max_batched,
            enable_chunked_prefill=False,
            max_model_len=max_model_len,
        ),
        device=DeviceConfig(
            device=device,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
        ),
    )


def _pooling_max_model_len(args: EngineArgs, hf_config: Any, max_seq_length: int | None) -> int:
    """The model's positions, capped by sentence-transformers' max_seq_length (what the model
    was trained and is served with); the user's max_model_len may go up to the positions."""
    positions = getattr(hf_config, "max_position_embeddings", None) or 2048
    if args.max_model_len is None:
        return min(positions, max_seq_length or positions)
    if args.max_model_len > positions:
        raise ValueError(
            f"max_model_len={args.max_model_len} is larger than the model's "
            f"max_position_embeddings={positions}; use at most {positions}"
        )
    return args.max_model_len
