"""The Qwen2.5-VL vision tower against transformers' on the same random weights."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    apply_rotary_pos_emb_vision,
)

from tinyvllm.models.qwen2_5_vl_layout import row_chunks, varlen_attention, vision_layout
from tinyvllm.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, rotate_qk

PATCH = 14


def _config(depth: int = 3, fullatt: tuple[int, ...] = (1,)) -> Qwen2_5_VLVisionConfig:
    # window_size 56 = 2 merged tokens per window side, so grids of odd merged size leave
    # partial windows at the right and bottom edges.
    return Qwen2_5_VLVisionConfig(
        depth=depth,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=40,
        patch_size=PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=list(fullatt),
    )


def _hf_model(config: Qwen2_5_VLVisionConfig, std: float = 0.2) -> torch.nn.Module:
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return model


def _ours(config: Qwen2_5_VLVisionConfig, hf: torch.nn.Module) -> Qwen2_5_VisionTransformer:
    model = Qwen2_5_VisionTransformer(config).eval()
    model.load_weights(hf.state_dict().items())
    return model


def _inputs(grids: list[tuple[int, int, int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    num_patches = int(grid_thw.prod(-1).sum())
    pixels = torch.randn(num_patches, 3 * 2 * PATCH * PATCH, generator=gen)
    return pixels, grid_thw


# Two images (one a single window, one with partial edge windows) and a 3-temporal-patch video.
MIXED = [(1, 4, 4), (1, 10, 6), (3, 6, 10)]


@pytest.mark.parametrize(
    ("depth", "fullatt", "grids"),
    [
        (3, (1,), MIXED),
        (2, (1,), [(2, 8, 8)]),  # window-aligned video: the extra all-padding window case
        (4, (0, 3), [(1, 2, 2), (1, 12, 4), (2, 2, 14)]),
    ],
)
def test_matches_hf_fp32(
    depth: int, fullatt: tuple[int, ...], grids: list[tuple[int, int, int]]
) -> None:
    config = _config(depth, fullatt)
    hf = _hf_model(config)
    ours = _ours(config, hf)
    pixels, grid_thw = _inputs(grids)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid_thw).pooler_output
        got = ours(pixels, grid_thw)
    assert got.shape == (int(grid_thw.prod(-1).sum()) // 4, config.out_hidden_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("chunk_rows", [16, 40])
def test_block_passes_over_runs_of_segments_match_hf(chunk_rows: int) -> None:
    # On CPU each block runs over runs of whole windows / frames of about chunk_rows
    # patches (the 3B tower: two 448x448 frames at a time); small runs here split every item.
    config = _config(depth=3, fullatt=(1,))
    hf = _hf_model(config)
    ours = _ours(config, hf)
    ours.chunk_rows = chunk_rows
    pixels, grid_thw = _inputs(MIXED)
    seen: list[int] = []
    ours.blocks[0].mlp.register_forward_hook(lambda _m, args, _o: seen.append(len(args[0])))
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid_thw).pooler_output
        got = ours(pixels, grid_thw)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # Windows hold at most 16 patches, so no windowed pass exceeds chunk_rows.
    assert len(seen) > 1 and max(seen) <= chunk_rows and sum(seen) == len(pixels)


def test_row_chunks_keep_segments_whole() -> None:
    seqlens = [16, 16, 8, 60, 16, 4]
    runs = row_chunks(seqlens, 32)
    assert runs == [(0, 32, [16, 16]), (32, 40, [8]), (40, 100, [60]), (100, 120, [16, 4])]
    assert row_chunks(seqlens, None) == [(0, 120, seqlens)]


@pytest.mark.parametrize(
    "seqlens",
    [[6, 6, 6], [6, 6, 4, 4, 4], [6, 4, 6, 4, 2]],  # one run; one run per length; interleaved
)
def test_varlen_attention_equals_attention_per_segment(seqlens: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(seqlens), 3, 2, 8, generator=gen)  # q/k/v are strided views
    q, k, v = qkv.unbind(1)
    got = varlen_attention(q, k, v, seqlens, scale=0.3)
    expected = []
    for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens), strict=True):
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * 0.3
        expected.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs).flatten(1))
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_qk_is_hf_rotary_bit_for_bit(dtype: torch.dtype) -> None:
    # One fused pass over q and k must round exactly like HF's float32 rotation.
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(50, 3, 4, 16, generator=gen) * 3).to(dtype)
    angles = torch.rand(50, 8, generator=gen) * 40
    q_hf, k_hf = apply_rotary_pos_emb_vision(
        qkv[:, 0], qkv[:, 1], torch.cat([angles, angles], -1).cos(),
        torch.cat([angles, angles], -1).sin(),
    )  # fmt: skip
    q, k = rotate_qk(qkv[:, :2], angles.cos(), angles.sin()).unbind(1)
    assert q.dtype == dtype
    assert torch.equal(q, q_hf) and torch.equal(k, k_hf)


def test_items_are_independent() -> None:
    # Encoding items one by one gives the same tokens as one batched call (the encoder cache
    # relies on it), so windows and frames never leak across items.
    config = _config()
    ours = _ours(config, _hf_model(config))
    pixels, grid_thw = _inputs(MIXED)
    with torch.no_grad():
        together = ours(pixels, grid_thw)
        parts = [
            ours(p, g[None])
            for p, g in zip(pixels.split(grid_thw.prod(-1).tolist()), grid_thw, strict=True)
        ]
    torch.testing.assert_close(together, torch.cat(parts), rtol=0, atol=1e-5)


def test_window_layout_is_a_permutation_with_window_segments() -> None:
    layout = vision_layout(torch.tensor(MIXED), merge=2, window=2)
    merged = sum(t * h * w for t, h, w in MIXED) // 4
    assert sorted(layout.window_index.tolist()) == list(range(merged))
    assert sum(layout.window_seqlens) == sum(layout.frame_seqlens) == merged * 4
    # Merged grids 2x2 -> 1 window; 5x3 -> 3x2 windows; 3 frames of 3x5 -> 3 x (2x3) windows.
    assert len(layout.window_seqlens) == 1 + 3 * 2 + 3 * 2 * 3
    assert max(layout.window_seqlens) == 2 * 2 * 4


def test_bad_inputs_name_the_problem() -> None:
    config = _config()
    ours = _ours(config, _hf_model(config))
    pixels, grid_thw = _inputs([(1, 4, 4)])
    with pytest.raises(ValueError, match="describes 32"):
        ours(pixels, torch.tensor([[2, 4, 4]]))
    with pytest.raises(ValueError, match=r"pixel_values must be \[num_patches, 1176\]"):
        ours(pixels[:, :100], grid_thw)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size=2"):
        ours(torch.zeros(15, 1176), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match=r"grid_thw must be \[num_items >= 1, 3\], got \[0, 3\]"):
        ours(torch.zeros(0, 1176), torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="has an empty item"):
        ours(torch.zeros(0, 1176), torch.tensor([[0, 4, 4]]))


def test_load_weights_reports_missing_and_unexpected() -> None:
    config = _config()
    hf = _hf_model(config)
    state = dict(hf.state_dict())
    state.pop("blocks.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.up_proj\.weight"):
        Qwen2_5_VisionTransformer(config).load_weights(state.items())
    state = dict(hf.state_dict(), **{"blocks.0.attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ValueError, match="unexpected tensor"):
        Qwen2_5_VisionTransformer(config).load_weights(state.items())


def test_rotary_stays_fp32_after_casting_the_model() -> None:
    # bf16 inverse frequencies would shift far-apart patches' angles by whole radians.
    model = Qwen2_5_VisionTransformer(_config())
    positions = torch.tensor([[0, 1], [300, 700], [1023, 5]])
    before = model.rotary_pos_emb(positions)
    model.to(torch.bfloat16)
    after = model.rotary_pos_emb(positions)
    assert after[0].dtype == torch.float32
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.slow
def test_matches_hf_at_qwen2_5_vl_3b_width() -> None:
    # The 3B tower's block shape (4 of its 32 blocks) on a 448x448 image: 1024 patches in
    # 16 windows of 64, plus one full-attention block over all of them.
    config = Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=2048,
        window_size=112,
        fullatt_block_indexes=[3],
    )
    hf = _hf_model(config, std=0.02)
    ours = _ours(config, hf)
    pixels, grid_thw = _inputs([(1, 32, 32)])
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid_thw).pooler_output
        got = ours(pixels, grid_thw)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
