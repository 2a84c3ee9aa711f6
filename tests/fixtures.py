"""Tiny local tokenizer and checkpoints (no network), plus helpers to drive a model directly.

`conftest.py` wraps these in session fixtures; import them directly only to build a
variant (`build_tiny_checkpoint(..., **config_overrides)`).
"""

from __future__ import annotations

import shutil
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 2000
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Tiny dimensions shared by every family; GQA with 2 query heads per kv head.
_TINY_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    # Std of the random projection weights (see `_randomize`).
    "initializer_range": 0.3,
}

# What each fixture family exercises beyond the plain architecture.
_FAMILY_VARIANTS: dict[str, dict[str, Any]] = {
    # Untied lm_head and llama3 frequency scaling (original length below our prompts).
    "llama": {
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # q/k/v bias (always on for Qwen2) and tied embeddings.
    "qwen2": {"tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1000000.0}},
    # Per-head q/k RMSNorm plus yarn rope, whose attention factor scales cos/sin.
    "qwen3": {
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    # A window shorter than most test prompts, applied to every layer.
    "mistral": {"tie_word_embeddings": False, "sliding_window": 8},
    # Sliding layers (window 6, local rope base) alternating with full ones (global base with
    # linear scaling), a query_pre_attn_scalar other than head_dim, final logit soft-capping.
    "gemma3": {
        "tie_word_embeddings": True,
        "num_hidden_layers": 4,
        "sliding_window": 6,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    },
}


def _stdlib_sources(max_bytes: int) -> list[str]:
    """Deterministic slice of the Python standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(out_dir: Path, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE tokenizer on ~2 MB of stdlib sources and save it (HF format).

    Specials: <|bos|> <|eos|> <|pad|> <|im_start|> <|im_end|> (ids 0-4). No BOS is added
    automatically. Any UTF-8 text round-trips through encode/decode.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_stdlib_sources(2_000_000), trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=_TINY_DIMS["max_position_embeddings"],
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_checkpoint(
    family: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0, **config_overrides: Any
) -> Path:
    """Save a random-weight float32 checkpoint of `family` plus the tokenizer to `out_dir`.

    `config_overrides` go straight into the transformers config (e.g. `sliding_window=4`,
    `num_hidden_layers=2`, `tie_word_embeddings=True`).
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    config_classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "gemma3": Gemma3TextConfig,
    }
    if family not in config_classes:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(config_classes)}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    kwargs: dict[str, Any] = {
        **_TINY_DIMS,
        **_FAMILY_VARIANTS[family],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **config_overrides,
    }
    if "rope_parameters" in kwargs:  # copies: transformers fills them in place
        kwargs["rope_parameters"] = {
            key: dict(value) if isinstance(value, dict) else value
            for key, value in kwargs["rope_parameters"].items()
        }
    config = config_classes[family](**kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, std=kwargs["initializer_range"])
    return save_with_tokenizer(model, out_dir, tokenizer_dir)


def save_with_tokenizer(model: torch.nn.Module, out_dir: Path, tokenizer_dir: Path) -> Path:
    """Save an HF model plus the tokenizer's files as one checkpoint directory."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)  # type: ignore[operator]
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file():
            shutil.copy(path, out_dir / path.name)
    return out_dir


def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Re-initialise every parameter so that nothing is trivially zero or one.

    HF inits biases to 0 and norms to 1, which would leave those code paths untested. The
    embedding / output projection get std 1: logits then have std ~8, so the next-token
    distribution is peaky and greedy picks are rarely near-ties.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                values = torch.randn(param.shape, generator=gen)
            elif "norm" in name:
                values = 1.0 + 0.2 * torch.randn(param.shape, generator=gen)
            else:
                values = std * torch.randn(param.shape, generator=gen)
            param.copy_(values)


def make_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int = 16,
) -> tuple[Any, torch.Tensor]:
    """AttentionMetadata for one step, plus the matching positions [T] (int64).

    Request i computes its last `query_lens[i]` tokens of `seq_lens[i]`; its tokens live in
    `block_tables[i]` (slot = block * block_size + offset).
    """
    from tinyvllm.attention.backend import AttentionMetadata

    positions: list[int] = []
    slots: list[int] = []
    for q_len, s_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        if len(blocks) * block_size < s_len:
            raise ValueError(f"{len(blocks)} blocks cannot hold {s_len} tokens")
        for pos in range(s_len - q_len, s_len):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    width = max(len(blocks) for blocks in block_tables)
    table = [list(blocks) + [0] * (width - len(blocks)) for blocks in block_tables]
    metadata = AttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )
    return metadata, torch.tensor(positions, dtype=torch.int64)


def bind_kv_caches(model: Any, backend: Any, num_blocks: int, block_size: int = 16) -> None:
    """Give every attention layer of `model` the backend and a zeroed KV tensor."""
    for layer in model.attention_layers():
        param = next(model.parameters())
        shape = backend.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.backend = backend
        layer.kv_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)


def pin_program_route(llm: Any) -> None:
    """Every step the native decode program supports runs on it: on CPUs with bf16 matmul the
    decode route otherwise sends some steps to the layers by measured time (decode_route.py),
    which would make program-step counts and program-vs-layers comparisons depend on timing."""
    from tinyvllm.native.decode_route import PROGRAM

    route = llm.engine.runner.platform.decode_route
    if route is not None:
        route.fixed = PROGRAM


def keep_program_rows(monkeypatch: Any) -> None:
    """The native decode program keeps its bf16 linears in the rows the per-layer path reads
    (no pair-layout copies, native/pair_copies.py): for tests comparing the two bit for bit."""
    from tinyvllm.native.ops import NativeCpuOps

    monkeypatch.setattr(NativeCpuOps, "bf16_pairs_fit", lambda self, weight: False)
