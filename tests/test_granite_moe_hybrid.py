"""GraniteMoeHybrid (Granite 4.0-H) against HF transformers on tiny random checkpoints, driven
step by step: packed prefill, chunked prefill carrying state, decode in mixed batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from granite_hybrid_fixtures import build_granite_checkpoint, load_granite, run_step
from test_models import hf_logprobs

from tinyvllm.models.registry import resolve_architecture

TOLERANCE = 1e-3
VARIANTS: dict[str, dict[str, Any]] = {
    "moe-rope": {},
    # Dense (the 350m / 1b shape): no experts, attention first, no positional embedding.
    "dense-nope": dict(
        num_local_experts=0,
        layer_types=["attention", "mamba", "mamba", "attention"],
        position_embedding_type=None,
        tie_word_embeddings=True,
    ),
    "moe-attention-last": dict(layer_types=["mamba", "mamba", "mamba", "attention"]),
}


def make_sequences(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def granite_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    out = tmp_path_factory.mktemp(f"granite-{request.param}")
    return build_granite_checkpoint(out, tokenizer_dir, **VARIANTS[request.param])


def check_schedule(model_dir: Path, schedule: list[tuple[int, ...]], slots: list[int]) -> None:
    """Run `schedule` (query lengths per step per request); every row must match HF."""
    model, backend = load_granite(model_dir)
    lengths = [sum(step[i] for step in schedule) for i in range(len(slots))]
    sequences = make_sequences(model.config.vocab_size, lengths, seed=sum(lengths))
    expected = hf_logprobs(model_dir, sequences)
    computed = [0] * len(slots)
    for query_lens in schedule:
        rows = run_step(model, backend, sequences, computed, query_lens, slots)
        for i, got in enumerate(rows):
            want = expected[i][computed[i] : computed[i] + query_lens[i]]
            assert (got - want).abs().max().item() < TOLERANCE, f"request {i} at {computed[i]}"
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        computed = [c + q for c, q in zip(computed, query_lens, strict=True)]


def test_packed_prefill_matches_transformers(granite_dir: Path) -> None:
    check_schedule(granite_dir, [(5, 19, 40)], slots=[4, 0, 2])


def test_chunked_prefill_and_decode_match_transformers(granite_dir: Path) -> None:
    # Chunks of 1 token with a carried state, prefill beside decode, then all decoding.
    schedule = [(5, 11, 23), (1, 9, 18), (1, 1, 1), (1, 1, 1)]
    check_schedule(granite_dir, schedule, slots=[1, 5, 3])


def test_layer_layout(granite_dir: Path) -> None:
    model, _ = load_granite(granite_dir)
    kinds = [
        "attention" if layer.self_attn is not None else "mamba" for layer in model.model.layers
    ]
    attn = model.attention_layers()
    assert len(attn) == kinds.count("attention")
    assert len(model.recurrent_layers()) == kinds.count("mamba")
    assert all(layer.scale == pytest.approx(0.2) for layer in attn)  # attention_multiplier
    assert resolve_architecture(model.config)[1].state_kind == "mamba_hybrid"


@pytest.mark.parametrize(
    ("layer_types", "message"),
    [
        (["mamba", "sliding_attention", "mamba", "mamba"], r"layer_types\[1\] is 'sliding_"),
        (["mamba", "attention", "mamba"], "layer_types has 3 entries but num_hidden_layers is 4"),
    ],
)
def test_bad_layer_types_fail_at_load(
    tmp_path: Path, tokenizer_dir: Path, layer_types: list[str], message: str
) -> None:
    from transformers import AutoConfig

    from tinyvllm.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM

    model_dir = build_granite_checkpoint(tmp_path / "ok", tokenizer_dir, num_hidden_layers=4)
    config = AutoConfig.from_pretrained(model_dir)
    config.layer_types = layer_types
    with pytest.raises(ValueError, match=message):
        GraniteMoeHybridForCausalLM(config, max_model_len=64)
