"""Llama-family parity with HF transformers through the paged attention path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from fixtures import bind_kv_caches, build_tiny_checkpoint, make_metadata
from transformers import AutoConfig, AutoModelForCausalLM

from tinyvllm.attention.backend import AttentionBackend, get_attention_backend
from tinyvllm.models.loader import load_model

BLOCK_SIZE = 16
PROMPT_LENS = (5, 19, 40)
EXTRA_TOKENS = 2  # tokens appended after the prompt, fed as decode steps
# Disjoint, deliberately unordered blocks per request (3 blocks cover 48 tokens).
BLOCK_TABLES = ((7, 2, 9), (4, 0, 8), (1, 5, 3))
NUM_BLOCKS = 10
TOLERANCE = 1e-3


def make_sequences(vocab_size: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the special tokens (ids 0-4) so the prompts are ordinary text tokens.
    return [torch.randint(5, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def load_ours(
    model_dir: Path, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, AttentionBackend]:
    config = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, dtype, torch.device("cpu"), max_model_len=256)
    backend = get_attention_backend(torch.device("cpu"), "torch")
    bind_kv_caches(model, backend, NUM_BLOCKS, BLOCK_SIZE)
    return model, backend


def hf_logprobs(
    model_dir: Path, sequences: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Per sequence, log_softmax of HF's logits at every position ([len, vocab], fp32)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    with torch.inference_mode():
        return [hf(torch.tensor([seq])).logits[0].float().log_softmax(-1) for seq in sequences]


def run_step(
    model: torch.nn.Module,
    backend: AttentionBackend,
    sequences: Sequence[Sequence[int]],
    computed: Sequence[int],
    query_lens: Sequence[int],
) -> list[torch.Tensor]:
    """One engine step: request i computes tokens [computed[i], computed[i] + query_lens[i]).

    Returns each request's log_softmax rows for those tokens.
    """
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    metadata, positions = make_metadata(query_lens, seq_lens, BLOCK_TABLES, BLOCK_SIZE)
    input_ids = torch.tensor(
        [t for seq, c, s in zip(sequences, computed, seq_lens, strict=True) for t in seq[c:s]]
    )
    backend.plan(metadata)
    with torch.inference_mode():
        hidden = model(input_ids, positions, metadata)
        logprobs = model.compute_logits(hidden).log_softmax(-1)
    assert hidden.shape == (len(input_ids), model.config.hidden_size)
    return list(logprobs.split(list(query_lens)))


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours - theirs).abs().max().item()


def test_prefill_matches_transformers(tiny_model_dir: Path) -> None:
    model, backend = load_ours(tiny_model_dir)
    prompts = make_sequences(model.config.vocab_size, PROMPT_LENS)
    expected = hf_logprobs(tiny_model_dir, prompts)
    ours = run_step(model, backend, prompts, [0, 0, 0], PROMPT_LENS)
    for got, want in zip(ours, expected, strict=True):
        assert got.dtype == torch.float32
        assert max_diff(got, want) < TOLERANCE
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def check_chunked_schedule(model_dir: Path) -> None:
    """Prefill in two chunks (the second attends to the cached first), then decode twice,
    with prefill and decode requests mixed in one batch; every row must match HF."""
    model, backend = load_ours(model_dir)
    lengths = [n + EXTRA_TOKENS for n in PROMPT_LENS]
    sequences = make_sequences(model.config.vocab_size, lengths, seed=1)
    expected = hf_logprobs(model_dir, sequences)
    schedule = [(5, 11, 23), (1, 9, 18), (1, 1, 1)]
    assert [sum(step[i] for step in schedule) for i in range(3)] == lengths
    computed = [0, 0, 0]
    for query_lens in schedule:
        rows = run_step(model, backend, sequences, computed, query_lens)
        for i, got in enumerate(rows):
            want = expected[i][computed[i] : computed[i] + query_lens[i]]
            assert max_diff(got, want) < TOLERANCE, f"request {i} at {computed[i]}"
        computed = [c + q for c, q in zip(computed, query_lens, strict=True)]


def test_chunked_prefill_and_decode_match_transformers(tiny_model_dir: Path) -> None:
    check_chunked_schedule(tiny_model_dir)


def test_qwen2_mixed_full_and_sliding_layers(tmp_path: Path, tokenizer_dir: Path) -> None:
    model_dir = build_tiny_checkpoint(
        "qwen2",
        tmp_path / "qwen2-swa",
        tokenizer_dir,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    model, _ = load_ours(model_dir)
    assert [layer.sliding_window for layer in model.attention_layers()] == [None, 6, 6]
    check_chunked_schedule(model_dir)


def test_attention_layer_layout(tiny_models: Mapping[str, Path]) -> None:
    for family, window in [("llama", None), ("qwen2", None), ("qwen3", None), ("mistral", 8)]:
        model, _ = load_ours(tiny_models[family])
        layers = model.attention_layers()
        assert len(layers) == model.config.num_hidden_layers
        for idx, layer in enumerate(layers):
            assert (layer.layer_idx, layer.num_heads, layer.num_kv_heads) == (idx, 4, 2)
            assert layer.head_dim == 16
            assert layer.scale == pytest.approx(16**-0.5)
            assert layer.sliding_window == window
    qwen2, _ = load_ours(tiny_models["qwen2"])
    assert qwen2.lm_head.weight is qwen2.model.embed_tokens.weight  # tied to the embedding
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None
    assert qwen2.model.layers[0].self_attn.o_proj.bias is None


def test_bfloat16_close_to_transformers(tiny_models: Mapping[str, Path]) -> None:
    model_dir = tiny_models["qwen3"]
    model, backend = load_ours(model_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    prompts = make_sequences(model.config.vocab_size, PROMPT_LENS)
    expected = hf_logprobs(model_dir, prompts, dtype=torch.bfloat16)
    ours = run_step(model, backend, prompts, [0, 0, 0], PROMPT_LENS)
    for got, want in zip(ours, expected, strict=True):
        assert got.dtype == torch.float32
        # The tiny models' activations reach ~70, so bf16 rounding alone moves log-probs by
        # a few tenths; this catches dtype-handling bugs, which cost several nats.
        top = want.argmax(-1, keepdim=True)
        assert max_diff(got.gather(-1, top), want.gather(-1, top)) < 0.5
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
