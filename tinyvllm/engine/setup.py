"""Resolving EngineArgs against the model on disk: EngineConfig and the tokenizer."""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyvllm.config import (
    DEFAULT_MAX_NUM_SEQS,
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from tinyvllm.quant.config import QuantConfig

if TYPE_CHECKING:
    from tinyvllm.runner.kv_cache import KVCacheSize

logger = logging.getLogger(__name__)


def build_engine_config(args: EngineArgs) -> EngineConfig:
    from tinyvllm.models.checkpoint import resolve_checkpoint
    from tinyvllm.quant.config import resolve_quantization
    from tinyvllm.utils.device import choose_dtype, resolve_device

    model, gguf_file = _catalog_files(args.model, args.gguf_file)
    checkpoint = resolve_checkpoint(
        model, gguf_file, args.revision, args.download_dir, args.trust_remote_code
    )
    model_path, hf_config = checkpoint.path, checkpoint.hf_config
    gguf_path = model_path if checkpoint.is_gguf else None
    quantization = resolve_quantization(args.quantization, gguf_path)
    device = resolve_device(args.device)
    if args.int8_activations:
        quantization = int8_activation_config(quantization, str(device), str(model_path))
    config_dtype = getattr(hf_config, "dtype", None)
    if runner_type(args, checkpoint) == "pooling":
        from tinyvllm.engine.pooling_setup import build_pooling_config

        # A config that names no dtype (older sentence-transformers exports) holds fp32
        # weights, which HF and sentence-transformers also run in fp32.
        dtype = choose_dtype(args.dtype, config_dtype or "float32", device)
        return build_pooling_config(args, checkpoint, dtype, str(device), quantization)
    dtype = choose_dtype(args.dtype, config_dtype, device)
    cache = CacheConfig(
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        mamba_cache_mode=args.mamba_cache_mode,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
    )

    # Tables sized by the context (rope, request rows) are built before the KV cache is
    # sized, so a context that cannot fit must shrink (or fail) here, not after.
    kv_tokens, table_tokens = _context_bounds(hf_config, dtype, device, cache, args)
    max_model_len = _max_model_len(args, hf_config, kv_tokens, table_tokens, cache.block_size)
    max_batched = _max_num_batched_tokens(args, max_model_len)
    return EngineConfig(
        model=model_config(args, checkpoint, dtype, max_model_len, quantization),
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_seqs=resolved_max_num_seqs(args),
            max_num_seqs_explicit=args.max_num_seqs is not None,
            max_num_batched_tokens=max_batched,
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_model_len=max_model_len,
            num_lookahead_tokens=_lookahead(args.speculative_config),
            atomic_mm_spans=_bidirectional_media(hf_config),
        ),
        device=DeviceConfig(
            device=str(device),
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            fp32_weight_copy_bytes=args.fp32_weight_copy_bytes,
        ),
        speculative=_speculative_config(args.speculative_config),
    )


def model_config(
    args: EngineArgs,
    checkpoint: Any,
    dtype: str,
    max_model_len: int,
    quantization: QuantConfig | None,
    **extra: Any,
) -> ModelConfig:
    """The ModelConfig of `checkpoint` as `args` ask for it; `extra` sets further fields."""
    return ModelConfig(
        model=args.model,
        model_path=str(checkpoint.path),
        tokenizer=args.tokenizer or str(checkpoint.path),
        dtype=dtype,
        max_model_len=max_model_len,
        vocab_size=checkpoint.hf_config.vocab_size,
        seed=args.seed,
        hf_config=checkpoint.hf_config,
        max_model_len_explicit=args.max_model_len is not None,
        quantization=quantization,
        requested_quantization=args.quantization,
        video_pruning_rate=float(args.video_pruning_rate or 0.0),
        **extra,
    )


def int8_activation_config(
    quantization: QuantConfig | None, device: str, model_path: str
) -> QuantConfig:
    """`quantization` with int8 activations switched on; ValueError where they cannot apply
    (no quantized GGUF weights kept as blocks, or not on the CPU)."""
    if quantization is None or quantization.method != "gguf":
        raise ValueError(
            f"int8_activations=True needs quantized GGUF weights (quantization='auto' or "
            f"'gguf' with a GGUF file that holds Q4_0 / Q4_1 / Q8_0 tensors); {model_path} "
            f"loads with quantization={quantization and str(quantization)!r}"
        )
    if not device.startswith("cpu"):
        raise ValueError(
            f"int8_activations=True runs on the CPU's native kernels only; got device "
            f"{device!r} (use device='cpu')"
        )
    return replace(quantization, int8_activations=True)


def resolved_max_num_seqs(args: EngineArgs) -> int:
    """The user's max_num_seqs, else the default (which a hybrid model may lower later)."""
    return args.max_num_seqs if args.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS


def runner_type(args: EngineArgs, checkpoint: Any) -> str:
    """The runner, "generate" or "pooling", for `args.runner` on this checkpoint ("auto":
    pooling for encoder-only architectures and sentence-transformers directories)."""
    from tinyvllm.models.registry import resolve_architecture
    from tinyvllm.models.sentence_transformers import is_sentence_transformers_dir

    arch, entry = resolve_architecture(checkpoint.hf_config)
    if args.runner == "auto":
        if "generate" not in entry.runners:
            return "pooling"
        st_dir = not checkpoint.is_gguf and is_sentence_transformers_dir(checkpoint.path)
        return "pooling" if st_dir else "generate"
    if args.runner not in entry.runners and args.runner == "generate":
        raise ValueError(
            f"{arch} is an encoder-only model: it computes embeddings and cannot generate "
            f"text; use runner='pooling' (or 'auto') with embed() / encode()"
        )
    if args.runner not in entry.runners:
        raise ValueError(
            f"{arch} cannot run as a pooling model (its recurrent state is kept by the "
            f"generate runner only); use runner='generate' (or 'auto')"
        )
    return args.runner


def _max_model_len(
    args: EngineArgs, hf_config: Any, kv_tokens: int, table_tokens: int, block_size: int
) -> int:
    """The user's max_model_len checked against the model and the memory, or the largest
    context (up to the model's) that fits."""
    derived = getattr(hf_config, "max_position_embeddings", None) or 2048
    if args.max_model_len is None:
        max_model_len = min(derived, max(min(kv_tokens, table_tokens), block_size))
        if max_model_len < derived:
            logger.warning(
                "the model's context of %d tokens cannot fit in memory here; serving with "
                "max_model_len=%d (pass max_model_len or more KV memory to change it)",
                derived,
                max_model_len,
            )
        return max_model_len
    if args.max_model_len > derived:
        raise ValueError(
            f"max_model_len={args.max_model_len} is larger than the model's "
            f"max_position_embeddings={derived}; use at most {derived}"
        )
    if args.max_model_len > kv_tokens:
        raise ValueError(
            f"max_model_len={args.max_model_len} cannot fit: the KV cache can hold at most "
            f"{kv_tokens} tokens of {args.model!r} here; lower max_model_len or give the KV "
            "cache more memory"
        )
    return args.max_model_len


def _max_num_batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    if args.max_num_batched_tokens is not None:
        max_batched = args.max_num_batched_tokens
    else:
        max_batched = 8192 if args.enable_chunked_prefill else max(8192, max_model_len)
    if max_batched < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_batched}")
    if not args.enable_chunked_prefill and max_batched < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={max_batched} is smaller than max_model_len="
            f"{max_model_len}: without chunked prefill a full prompt must fit in one step; "
            "raise max_num_batched_tokens or enable_chunked_prefill"
        )
    return max_batched


# Share of the CPU KV budget the per-position tables may take (rope cos/sin, and the
# runner's token rows: one int64 column per sequence slot).
_TABLES_FRACTION = 8


def _context_bounds(
    hf_config: Any, dtype: str, device: Any, cache: CacheConfig, args: EngineArgs
) -> tuple[int, int]:
    """(tokens the KV cache can hold at most, positions the per-position tables fit in)."""
    from tinyvllm.runner.kv_cache import cpu_kv_budget_bytes, max_kv_tokens

    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    elem = 4 if dtype == "float32" else 2
    per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * elem
    per_position = 2 * 4 * head_dim + 8 * (resolved_max_num_seqs(args) + 1)
    tables = cpu_kv_budget_bytes() // _TABLES_FRACTION // per_position
    return max_kv_tokens(cache, per_token, device), tables


def _catalog_files(model: str, gguf_file: str | None) -> tuple[str, str | None]:
    """A catalog name (`LLM("SmolLM2-135M-Instruct")`) -> its files; anything else as given.
    Paths and hub ids ("org/name") never reach the catalog."""
    exists = os.path.exists(os.path.expanduser(model))
    if gguf_file is None and not exists and model.lower().endswith(".gguf"):
        # Relative like absolute: a missing .gguf file is missing, not a hub repo id.
        raise FileNotFoundError(f"no such GGUF file: {model!r}")
    if gguf_file is not None or "/" in model or exists:
        return model, gguf_file
    from tinyvllm.catalog import resolve_catalog_name

    resolved = resolve_catalog_name(model)
    return (model, gguf_file) if resolved is None else (resolved.model, resolved.gguf_file)


def _lookahead(config: Any) -> int:
    """Slots a draft model writes past the scheduled tokens (its K - 1 decode inputs, plus
    one of slack)."""
    spec = _speculative_config(config)
    return 0 if spec is None or spec.method != "draft_model" else spec.num_speculative_tokens


def _speculative_config(config: Any) -> Any:
    if config is None:
        return None
    from tinyvllm.spec_decode import SpeculativeConfig

    return SpeculativeConfig.from_dict(config)


def resolve_tokenizer(tokenizer: Any) -> Any:
    """An engine's tokenizer argument: the tokenizer (or None), or the Future of one that
    `create_engine` loads while the engine loads its model (its error raises here)."""
    return tokenizer.result() if isinstance(tokenizer, Future) else tokenizer


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    from tinyvllm.gguf.reader import is_gguf_file

    if is_gguf_file(name):
        from tinyvllm.gguf.tokenizer_cache import load_gguf_tokenizer

        return load_gguf_tokenizer(name)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ValueError(
            f"cannot load a tokenizer from {name}: {exc}. The model directory needs "
            "tokenizer.json or tokenizer.model with tokenizer_config.json"
        ) from exc


def _bidirectional_media(hf_config: Any) -> bool:
    """Whether the model attends its media spans bidirectionally (Gemma 3's images), so the
    scheduler must keep each span in one chunk."""
    from tinyvllm.models.registry import resolve_architecture

    try:
        return resolve_architecture(hf_config)[1].state_kind == "gemma3_mm"
    except ValueError:
        return False  # the model loader names the unsupported architecture


def fit_to_kv_cache(config: EngineConfig, kv_size: KVCacheSize) -> EngineConfig:
    """The config the engine serves with: `config` with the context the KV cache allows and,
    for a hybrid model, no more running requests than it has state slots (the caller's config
    is left as it was)."""
    max_model_len = kv_size.max_model_len
    max_num_seqs = config.scheduler.max_num_seqs
    if kv_size.num_running_states:
        max_num_seqs = min(max_num_seqs, kv_size.num_running_states)
    if (
        max_model_len == config.model.max_model_len == config.scheduler.max_model_len
        and max_num_seqs == config.scheduler.max_num_seqs
    ):
        return config
    return replace(
        config,
        model=replace(config.model, max_model_len=max_model_len),
        scheduler=replace(config.scheduler, max_model_len=max_model_len, max_num_seqs=max_num_seqs),
    )


def eos_token_id(config: EngineConfig, tokenizer: Any) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(config.model.hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


def generation_config_eos(config: EngineConfig, eos: int | None) -> set[int]:
    """EOS ids from generation_config.json besides the tokenizer's (e.g. Llama 3's <|eot_id|>)."""
    # Read as plain JSON: transformers' GenerationConfig costs a second of imports.
    file = Path(config.model.model_path) / "generation_config.json"
    try:
        ids = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # absent (a GGUF file), unreadable, not a dict
        return set()
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    if not isinstance(ids, list):
        return set()
    found = {i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0}
    return found - ({eos} if eos is not None else set())
