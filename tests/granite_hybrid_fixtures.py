"""Tiny random GraniteMoeHybrid checkpoints (Granite 4.0-H shape) and a driver that runs our
model on hand-built steps, with its KV caches and recurrent-state slots bound here."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from fixtures import _randomize, make_metadata
from test_models import load_ours

from tinyvllm.attention.backend import AttentionBackend
from tinyvllm.attention.recurrent import RecurrentMetadata

BLOCK_SIZE = 16  # as test_models.load_ours binds the KV caches
NUM_SLOTS = 6

# Non-trivial Granite scalars so that each one is exercised; chunk_size 8 makes every prompt
# here cross SSD chunk boundaries.
TINY_GRANITE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=32,
    shared_intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    position_embedding_type="rope",
    embedding_multiplier=3.0,
    attention_multiplier=0.2,
    residual_multiplier=0.6,
    logits_scaling=2.5,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


TINY_NEMOTRON_H: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=512,
)


def build_granite_checkpoint(
    out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides: Any
) -> Path:
    """A random-weight float32 GraniteMoeHybrid checkpoint plus the tokenizer in `out_dir`."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    return _save_hybrid(
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        {**TINY_GRANITE, **overrides},
        out_dir,
        tokenizer_dir,
        seed,
    )


def build_nemotron_h_checkpoint(
    out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides: Any
) -> Path:
    """A random-weight float32 NemotronH checkpoint (dense blocks) plus the tokenizer."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return _save_hybrid(
        NemotronHConfig,
        NemotronHForCausalLM,
        {**TINY_NEMOTRON_H, **overrides},
        out_dir,
        tokenizer_dir,
        seed,
    )


def _save_hybrid(
    config_cls: Any,
    model_cls: Any,
    values: dict[str, Any],
    out_dir: Path,
    tokenizer_dir: Path,
    seed: int,
) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = config_cls(
        **{
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **values,
        }
    )
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed, std=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Larger mixer weights than _randomize's, so the recurrent state visibly matters.
        for module in model.modules():
            if not hasattr(module, "A_log"):
                continue
            for name, param in module.named_parameters():
                if name == "A_log":
                    # A = -exp(A_log) in (-0.37, -0.007): a state that remembers tens of
                    # tokens, so a lost or wrong state changes later tokens, not just the next.
                    param.copy_(-1.0 - 4.0 * torch.rand(param.shape, generator=gen))
                elif "norm" not in name:
                    param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file():
            shutil.copy(path, Path(out_dir) / path.name)
    return Path(out_dir)


def load_granite(model_dir: Path) -> tuple[torch.nn.Module, AttentionBackend]:
    """Our model on the CPU in float32 with zeroed KV caches and state slots bound."""
    model, backend = load_ours(model_dir)
    for layer in model.recurrent_layers():
        layer.states = [
            torch.zeros(NUM_SLOTS, *s.shape, dtype=s.dtype) for s in layer.state_shapes()
        ]
    return model, backend


def run_step(
    model: torch.nn.Module,
    backend: AttentionBackend,
    sequences: Sequence[Sequence[int]],
    computed: Sequence[int],
    query_lens: Sequence[int],
    slots: Sequence[int],
) -> list[torch.Tensor]:
    """Request i computes tokens [computed[i], computed[i] + query_lens[i]) with state slot
    slots[i] and KV blocks 3i..3i+2; returns each request's log_softmax rows."""
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(query_lens))]
    metadata, positions = make_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    metadata.recurrent = RecurrentMetadata.build(
        list(slots), [c > 0 for c in computed], list(query_lens), torch.device("cpu")
    )
    input_ids = torch.tensor(
        [t for seq, c, s in zip(sequences, computed, seq_lens, strict=True) for t in seq[c:s]]
    )
    backend.plan(metadata)
    with torch.inference_mode():
        hidden = model(input_ids, positions, metadata)
        logprobs = model.compute_logits(hidden).log_softmax(-1)
    return list(logprobs.split(list(query_lens)))
