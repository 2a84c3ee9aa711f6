"""Rotary frequencies and rotation match transformers for every supported rope type."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding, compute_inv_freq

HEAD_DIM = 16
MAX_POS = 512
LONG_FACTORS = [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]
SHORT_FACTORS = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]

ROPE_CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "linear-partial": {
        "rope_type": "linear",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "partial_rotary_factor": 0.5,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn-mscale-notruncate": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 256,
        "attention_factor": 0.8,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 128,
        "long_factor": LONG_FACTORS,
        "short_factor": SHORT_FACTORS,
    },
}


def hf_config(rope_parameters: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(rope_parameters),
    )


def hf_inv_freq(config: LlamaConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("seq_len", [256, 2048])
def test_inv_freq_matches_transformers(case: str, seq_len: int) -> None:
    config = hf_config(ROPE_CASES[case])
    rope = RopeConfig.from_hf_config(config)
    ours, ours_factor = compute_inv_freq(rope, seq_len=seq_len)
    theirs, their_factor = hf_inv_freq(config, seq_len)
    assert ours.dtype == torch.float32
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert ours_factor == pytest.approx(their_factor, rel=1e-12)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_tables_are_hf_formula_exactly(case: str) -> None:
    """cos/sin tables equal HF's cos(cat(freqs, freqs)) * attention_factor bit for bit (they
    are built from half-width tables to spare memory)."""
    rope = RopeConfig.from_hf_config(hf_config(ROPE_CASES[case]))
    table = RotaryEmbedding(rope, MAX_POS)
    inv_freq, factor = compute_inv_freq(rope, seq_len=MAX_POS)
    emb = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq).repeat(1, 2)
    assert torch.equal(table.cos_cache, emb.cos() * factor)
    assert torch.equal(table.sin_cache, emb.sin() * factor)


def test_dynamic_is_default_within_trained_length() -> None:
    dynamic = RopeConfig.from_hf_config(hf_config(ROPE_CASES["dynamic"]))
    default = RopeConfig.from_hf_config(hf_config(ROPE_CASES["default"]))
    assert torch.equal(compute_inv_freq(dynamic, MAX_POS)[0], compute_inv_freq(default)[0])
    assert not torch.equal(compute_inv_freq(dynamic, 4 * MAX_POS)[0], compute_inv_freq(default)[0])


def test_legacy_rope_scaling_and_theta() -> None:
    legacy = SimpleNamespace(
        rope_scaling={"type": "linear", "factor": 2.0},
        rope_theta=500000.0,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
    )
    rope = RopeConfig.from_hf_config(legacy)
    assert (rope.rope_type, rope.theta, rope.head_dim, rope.rotary_dim) == (
        "linear",
        500000.0,
        16,
        16,
    )
    no_scaling = SimpleNamespace(
        rope_scaling=None, rope_theta=1e6, head_dim=32, max_position_embeddings=MAX_POS
    )
    rope = RopeConfig.from_hf_config(no_scaling)
    assert (rope.rope_type, rope.theta, rope.rotary_dim) == ("default", 1e6, 32)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match=r"rope_type='mystery'.*supported: \['default'"):
        RopeConfig.from_hf_config(hf_config({"rope_type": "mystery", "rope_theta": 1.0}))


@pytest.mark.parametrize("case", ["default", "llama3", "yarn", "yarn-mscale-notruncate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_transformers(case: str, dtype: torch.dtype) -> None:
    config = hf_config(ROPE_CASES[case])
    num_tokens, num_heads, num_kv_heads = 37, 4, 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, num_heads * HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads * HEAD_DIM, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen)

    rotary = RotaryEmbedding(RopeConfig.from_hf_config(config), max_position=MAX_POS)
    q_ours, k_ours = rotary(positions, q, k)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(
        q.view(1, num_tokens, num_heads, HEAD_DIM).transpose(1, 2),
        k.view(1, num_tokens, num_kv_heads, HEAD_DIM).transpose(1, 2),
        cos,
        sin,
    )
    assert q_ours.dtype == dtype
    torch.testing.assert_close(q_ours, q_hf.transpose(1, 2).reshape(num_tokens, -1))
    torch.testing.assert_close(k_ours, k_hf.transpose(1, 2).reshape(num_tokens, -1))


def test_partial_rotary_leaves_tail_untouched() -> None:
    rope = RopeConfig.from_hf_config(hf_config(ROPE_CASES["linear-partial"]))
    assert rope.rotary_dim == HEAD_DIM // 2
    rotary = RotaryEmbedding(rope, max_position=64)
    q = torch.randn(5, 4 * HEAD_DIM)
    k = torch.randn(5, 2 * HEAD_DIM)
    q_out, k_out = rotary(torch.arange(5) + 3, q, k)
    tail = slice(HEAD_DIM // 2, HEAD_DIM)
    assert torch.equal(q_out.view(5, 4, HEAD_DIM)[..., tail], q.view(5, 4, HEAD_DIM)[..., tail])
    assert torch.equal(k_out.view(5, 2, HEAD_DIM)[..., tail], k.view(5, 2, HEAD_DIM)[..., tail])
    assert not torch.equal(q_out, q)
    # Position 0 is the identity rotation.
    q0, _ = rotary(torch.zeros(5, dtype=torch.long), q, k)
    torch.testing.assert_close(q0, q)
