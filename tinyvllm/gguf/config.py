"""GGUF metadata -> a transformers `PretrainedConfig` for our model classes (the tokenizer
rebuilt from the file's vocabulary is in `gguf.tokenizer_cache`)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from tinyvllm.gguf.model_config import MODEL_TYPES, own_config_class
from tinyvllm.gguf.reader import GGUFFile, read_gguf

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> (transformers model_type, our architecture name). Mistral
# checkpoints are converted as "llama" and load as Llama (as llama.cpp runs them).
GGUF_ARCHITECTURES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "llama": ("llama", "LlamaForCausalLM"),
        "qwen2": ("qwen2", "Qwen2ForCausalLM"),
        "qwen3": ("qwen3", "Qwen3ForCausalLM"),
        "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    }
)
_GGUF_NAME_OF_MODEL_TYPE = MappingProxyType({"gemma3_text": "gemma3"})

# What llama.cpp assumes for Gemma 3 files that do not say: every 6th layer attends globally,
# the sliding layers rotate with base 10000.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Gemma 3 27B scales queries by (hidden / heads)^-0.5, the others by head_dim^-0.5 (llama.cpp
# recognises the 27B by its layer count).
_GEMMA3_27B_LAYERS = 62

# GGUF architectures of models tinyvllm runs from safetensors but not (yet) from GGUF: their
# recurrent-layer tensors have no mapping here.
GGUF_NOT_YET: Mapping[str, str] = MappingProxyType(
    {
        "lfm2": "LiquidAI/LFM2-350M",
        "granitehybrid": "ibm-granite/granite-4.0-h-350m",
    }
)

# general.file_type -> the dtype "auto" picks (fp16 becomes bf16 on CPU later); any
# quantized file runs in bf16, whose range is safe for dequantized weights.
_FILE_TYPE_DTYPES: Mapping[int, str] = MappingProxyType(
    {0: "float32", 1: "float16", 32: "bfloat16"}
)


# The HF config field each GGUF `{arch}.` key becomes (errors name both).
HF_FIELD_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "vocab_size": "vocab_size",
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "head_dim": "attention.key_length",
        "max_position_embeddings": "context_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "rope_theta": "rope.freq_base",
    }
)


def hf_field_names(architecture: str) -> dict[str, str]:
    """HF config field -> the full GGUF metadata key it came from, for messages
    (`architecture`: the GGUF one, or the transformers model_type it became)."""
    architecture = _GGUF_NAME_OF_MODEL_TYPE.get(architecture, architecture)
    return {field: f"{architecture}.{key}" for field, key in HF_FIELD_KEYS.items()}


def _bad(gf: GGUFFile, key: str, why: str, value: Any) -> ValueError:
    return ValueError(
        f"GGUF file {gf.path.name!r}: metadata {gf.architecture}.{key} {why}, got {value!r}"
    )


def _int(gf: GGUFFile, key: str, default: int | None = None, minimum: int = 1) -> int:
    """`{arch}.{key}` as an integer >= minimum (`default` when absent; required without)."""
    value = gf.arch_value(key)
    if value is None:
        if default is None:
            raise ValueError(
                f"GGUF file {gf.path.name!r} lacks the metadata {gf.architecture}.{key}"
            )
        return default
    if isinstance(value, list):
        # Some converters store head counts per layer; we need them all equal.
        if not value or len(set(map(repr, value))) != 1:
            raise _bad(gf, key, "must be the same for every layer", value)
        value = value[0]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(gf, key, f"must be an integer of at least {minimum}", value)
    return value


def _float(gf: GGUFFile, key: str, default: float) -> float:
    """`{arch}.{key}` as a finite positive number (`default` when absent or zero)."""
    value = gf.arch_value(key)
    if value is None or value == 0:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(gf, key, "must be a number", value)
    if not math.isfinite(value) or value < 0:
        raise _bad(gf, key, "must be a finite positive number", value)
    return float(value)


def check_architecture(gf: GGUFFile) -> tuple[str, str]:
    """(model_type, architecture) for the file; ValueError naming unsupported ones."""
    arch = gf.architecture
    if arch in GGUF_NOT_YET:
        raise ValueError(
            f"GGUF architecture {arch!r} (a hybrid model with recurrent layers) is not supported "
            f"yet from GGUF files; load its safetensors checkpoint instead (e.g. "
            f"{GGUF_NOT_YET[arch]!r})"
        )
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return GGUF_ARCHITECTURES[arch]


def _rope_scaling(gf: GGUFFile, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF `rope_scaling` from the rope.scaling.* keys (or Llama 3's rope_freqs tensor)."""
    kind = gf.arch_value("rope.scaling.type")
    factor = _float(gf, "rope.scaling.factor", 0.0) or _float(gf, "rope.scale_linear", 0.0)
    if kind is None and factor and factor != 1.0:
        kind = "linear"  # the pre-`scaling.type` key
    if kind in (None, "none"):
        if "rope_freqs.weight" in gf.tensors:
            return _llama3_from_rope_freqs(gf, theta, head_dim)
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = _int(gf, "rope.scaling.original_context_length", 0, minimum=0)
        if original:
            scaling["original_max_position_embeddings"] = original
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _float(gf, f"rope.scaling.{key}", 0.0)
            if value:
                scaling[hf_key] = value
        return scaling
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (linear and yarn are)")


def _llama3_from_rope_freqs(gf: GGUFFile, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover Llama 3 scaling parameters from the per-frequency divisors llama.cpp stores.

    The divisors are 1 for short wavelengths, `factor` for long ones and blended between;
    with Llama 3's low/high frequency factors (1, 4) a blended entry pins down the original
    context length. The fit is checked against every divisor before it is accepted.
    """
    info = gf.tensors["rope_freqs.weight"]
    if info.qtype != 0 or info.shape != (head_dim // 2,):
        raise ValueError(
            f"rope_freqs tensor of type {info.qtype_name} and shape {info.shape} is not "
            f"supported (expected F32 of shape ({head_dim // 2},))"
        )
    divisors = np.frombuffer(gf.raw("rope_freqs.weight").numpy().tobytes(), dtype="<f4")
    divisors = divisors.astype(np.float64)
    factor = float(divisors.max())
    low, high = 1.0, 4.0
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    candidates = {2**k for k in range(6, 21)}
    if factor > 1.0:
        blended = (divisors > 1.0) & (divisors < factor)
        smooth = (1.0 / divisors[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
        candidates |= {round(float(c)) for c in wavelen[blended] * (smooth * (high - low) + low)}
    for original in sorted(candidates):
        smooth = (original / wavelen - low) / (high - low)
        with np.errstate(divide="ignore"):
            blend = 1.0 / ((1 - smooth) / factor + smooth)
        expected = np.where(
            wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blend)
        )
        if np.allclose(divisors, expected, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ValueError(
        "the GGUF file's rope_freqs tensor does not match Llama 3 rope scaling; "
        "custom per-frequency rope factors are not supported"
    )


def _config_class(model_type: str) -> Callable[..., Any]:
    """tinyvllm's config for the llama family and Gemma 3 (the same values, without importing
    transformers: over a second), transformers' config class for the others."""
    own = own_config_class(model_type) if model_type in MODEL_TYPES else None
    if own is not None:
        return own
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def gguf_to_hf_config(gf: GGUFFile) -> Any:
    """A transformers config (with `architectures` set) describing the GGUF model."""
    model_type, architecture = check_architecture(gf)
    hidden = _int(gf, "embedding_length")
    heads = _int(gf, "attention.head_count")
    kv_heads = _int(gf, "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise _bad(gf, "attention.head_count_kv", f"must divide head_count={heads}", kv_heads)
    head_dim = _int(gf, "attention.key_length", hidden // heads)
    rope_dim = _int(gf, "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"GGUF file {gf.path.name!r}: partial rotary embeddings (rope dimension "
            f"{rope_dim} of head_dim {head_dim}) are not supported for GGUF checkpoints"
        )
    theta = _float(gf, "rope.freq_base", 10000.0)
    embed = gf.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"GGUF file {gf.path.name!r} has no token_embd.weight tensor")
    vocab_size = _int(gf, "vocab_size", embed.shape[0] if embed.shape else 0)
    kwargs: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _int(gf, "feed_forward_length"),
        "num_hidden_layers": _block_count(gf),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _int(gf, "context_length", 2048),
        "rms_norm_eps": _float(gf, "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(gf, theta, head_dim),
        # llama.cpp writes no output tensor when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "hidden_act": "silu",
        "dtype": _file_dtype(gf.metadata.get("general.file_type")),
    }
    for key in ("bos", "eos", "pad"):
        name = f"tokenizer.ggml.{key}_token_id"
        token_id = gf.metadata.get(name)
        if token_id is None:
            continue
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(
                f"GGUF file {gf.path.name!r}: metadata {name} must be a token id, got {token_id!r}"
            )
        kwargs[f"{key}_token_id"] = token_id
    if model_type == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in gf.tensors
    if gf.architecture == "gemma3":
        _gemma3_fields(gf, kwargs)
    if "rope_scaling" in kwargs and kwargs["rope_scaling"] is None:  # gemma3 moved it
        del kwargs["rope_scaling"]
    try:
        return _config_class(model_type)(**kwargs)
    except Exception as exc:  # transformers validates sizes with its own error types
        detail = str(exc).splitlines()[-1].strip() if str(exc) else type(exc).__name__
        raise ValueError(
            f"GGUF file {gf.path.name!r}: its metadata is not a valid {model_type} config "
            f"({detail})"
        ) from None


def _gemma3_fields(gf: GGUFFile, kwargs: dict[str, Any]) -> None:
    """Gemma 3's config fields, with llama.cpp's defaults where the file is silent: the
    sliding pattern, the local rope base, the query scale and the soft-caps."""
    layers, theta = kwargs["num_hidden_layers"], kwargs.pop("rope_theta")
    scaling = kwargs.pop("rope_scaling") or {}
    kwargs.pop("hidden_act")
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    kwargs["sliding_window"] = _int(gf, "attention.sliding_window", 4096)
    kwargs["layer_types"] = _gemma3_layer_types(gf, layers)
    kwargs["rope_parameters"] = {
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": _float(gf, "rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE),
        },
        "full_attention": {"rope_type": "default", **scaling, "rope_theta": theta},
    }
    heads, hidden = kwargs["num_attention_heads"], kwargs["hidden_size"]
    kwargs["query_pre_attn_scalar"] = (
        hidden // heads if layers == _GEMMA3_27B_LAYERS else kwargs["head_dim"]
    )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = _float(gf, key, 0.0)
        kwargs[key] = value or None


def _gemma3_layer_types(gf: GGUFFile, layers: int) -> list[str]:
    """`attention.sliding_window_pattern`: a period (every n-th layer is global) or one flag
    per layer (true or 1: sliding; converters write bools or ints); without it llama.cpp's
    period of 6."""
    pattern = gf.arch_value("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(p in (0, 1) for p in pattern):
            raise _bad(
                gf, "attention.sliding_window_pattern", f"must be {layers} flags (0 / 1)", pattern
            )
        sliding = [bool(p) for p in pattern]
    else:
        period = _int(gf, "attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        sliding = [(i + 1) % period != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _block_count(gf: GGUFFile) -> int:
    """`block_count`, which must match the layers the tensor directory holds (the config
    allocates per layer before any tensor is read)."""
    count = _int(gf, "block_count")
    layers = {int(n.split(".")[1]) for n in gf.tensors if re.match(r"blk\.\d+\.", n)}
    if len(layers) != count or (layers and max(layers) != count - 1):
        raise _bad(gf, "block_count", f"must match the {len(layers)} layers of tensors", count)
    return count


def _file_dtype(file_type: Any) -> str:
    if isinstance(file_type, int) and file_type in _FILE_TYPE_DTYPES:
        return _FILE_TYPE_DTYPES[file_type]
    return "bfloat16"


def load_gguf_config(path: str | Path) -> Any:
    return gguf_to_hf_config(read_gguf(path))
