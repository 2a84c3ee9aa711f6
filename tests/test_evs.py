"""EVS retention rule: counts, masks, positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

from tinyvllm.multimodal.evs import (
    check_pruning_rate,
    compute_retained_tokens_count,
    compute_retention_mask,
    prune_video,
    retained_tokens_for_grid,
    video_mrope_positions,
)

MERGE = 2


def _static_clip(t: int, h: int, w: int, hidden: int = 8, seed: int = 0) -> torch.Tensor:
    """Merged embeddings whose temporal patches 2..t copy patch 1."""
    gen = torch.Generator().manual_seed(seed)
    frame = torch.randn(1, h * w, hidden, generator=gen)
    return frame.expand(t, -1, -1).reshape(t * h * w, hidden).clone()


@pytest.mark.parametrize(
    ("per_frame", "frames", "rate", "expected"),
    [
        (16, 8, 0.0, 128),
        (16, 8, 0.75, 32),
        (16, 8, 0.5, 64),
        (16, 4, 0.9, 16),  # int(6.4) < one frame: the first frame is the floor
        (6, 5, 0.25, 22),  # int(22.5)
        (1, 1, 0.99, 1),
    ],
)
def test_retained_count(per_frame: int, frames: int, rate: float, expected: int) -> None:
    assert compute_retained_tokens_count(per_frame, frames, rate) == expected
    grid = (frames, per_frame * MERGE, MERGE)  # h' = per_frame, w' = 1
    assert retained_tokens_for_grid(grid, MERGE, rate) == expected


@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75, 0.9])
def test_static_clip_keeps_first_frame_plus_the_minimum(rate: float) -> None:
    t, h, w = 4, 3, 5
    embeds = _static_clip(t, h, w)
    mask = compute_retention_mask(embeds, (t, h * MERGE, w * MERGE), MERGE, rate)
    count = compute_retained_tokens_count(h * w, t, rate)
    assert int(mask.sum()) == count
    assert mask[: h * w].all()  # the whole first frame
    if count == h * w:
        assert not mask[h * w :].any()


def test_changed_tokens_are_the_ones_kept() -> None:
    # Each temporal patch repeats the previous one except for a few replaced tokens; with room
    # for exactly frame 1 plus the replacements, EVS keeps exactly those.
    t, h, w, hidden = 4, 4, 4, 8
    gen = torch.Generator().manual_seed(3)
    frames = [torch.randn(h * w, hidden, generator=gen)]
    changed = {1: [0, 5, 6, 9, 10, 15], 2: [1, 2, 3, 4, 7], 3: [8, 11, 12, 13, 14]}
    expected = torch.zeros(t * h * w, dtype=torch.bool)
    expected[: h * w] = True
    for ti in range(1, t):
        frame = frames[-1].clone()
        frame[changed[ti]] = torch.randn(len(changed[ti]), hidden, generator=gen)
        frames.append(frame)
        expected[[ti * h * w + i for i in changed[ti]]] = True
    embeds = torch.cat(frames)
    assert compute_retained_tokens_count(h * w, t, 0.5) == int(expected.sum()) == 32
    mask = compute_retention_mask(embeds, (t, h * MERGE, w * MERGE), MERGE, 0.5)
    assert torch.equal(mask, expected)


def _naive_mask(embeds: np.ndarray, t: int, per_frame: int, keep: int) -> list[bool]:
    scores = []
    for i in range(t * per_frame):
        if i < per_frame:
            scores.append(255.0)
            continue
        a, b = embeds[i], embeds[i - per_frame]
        cos = float(a @ b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8)
        scores.append(1.0 - cos)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable
    kept = set(ranked[:keep])
    return [i in kept for i in range(len(scores))]


@pytest.mark.parametrize("seed", range(4))
def test_random_clip_matches_naive_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t, h, w = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    rate = float(rng.uniform(0, 0.95))
    embeds = rng.standard_normal((t * h * w, 16)).astype(np.float64)
    mask = compute_retention_mask(torch.from_numpy(embeds), (t, 2 * h, 2 * w), MERGE, rate)
    keep = compute_retained_tokens_count(h * w, t, rate)
    assert int(mask.sum()) == keep
    assert mask.tolist() == _naive_mask(embeds, t, h * w, keep)


def test_rate_zero_keeps_everything_unchanged() -> None:
    gen = torch.Generator().manual_seed(1)
    embeds = torch.randn(3 * 2 * 3, 8, generator=gen)
    pruned = prune_video(embeds, (3, 4, 6), MERGE, 0.0, time_interval=2.0)
    assert pruned.mask.all()
    assert torch.equal(pruned.embeds, embeds)
    assert torch.equal(pruned.positions, video_mrope_positions((3, 4, 6), MERGE, 2.0))


def test_pruned_positions_are_the_original_ones() -> None:
    t, h, w = 4, 2, 3
    embeds = _static_clip(t, h, w)
    embeds[h * w * 2 + 4] += 5.0  # one token moves in temporal patch 3 (t=2, row 1, col 1)
    pruned = prune_video(embeds, (t, h * MERGE, w * MERGE), MERGE, 0.75, time_interval=0.5)
    assert pruned.embeds.shape == (h * w, 8)  # count is one frame: the first frame only
    grid = (t, h * MERGE, w * MERGE)
    pruned = prune_video(embeds, grid, MERGE, 0.7, time_interval=0.5)
    # int(24 * 0.3) = 7: the first frame and the moved token (t index int(2 * 0.5) = 1).
    assert pruned.embeds.shape == (7, 8)
    assert pruned.positions[:, -1].tolist() == [1, 1, 1]
    assert torch.equal(pruned.embeds[-1], embeds[h * w * 2 + 4])


@pytest.mark.parametrize("time_interval", [1.0, 0.5, 2.0, 25 / 12])
def test_positions_match_hf(time_interval: float) -> None:
    grid = torch.tensor([5, 6, 8])
    hf = Qwen2_5_VLModel.get_vision_position_ids(
        None,  # type: ignore[arg-type]  (does not touch self)
        0,
        grid,
        1,
        MERGE,
        time_interval,
    )
    assert torch.equal(video_mrope_positions(grid, MERGE, time_interval), hf)


def test_bad_inputs() -> None:
    for rate in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"video_pruning_rate=.* is outside \[0, 1\)"):
            check_pruning_rate(rate)
    with pytest.raises(ValueError, match=r"expected \[24, hidden\]"):
        compute_retention_mask(torch.zeros(23, 4), (4, 4, 6), MERGE, 0.5)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size=2"):
        retained_tokens_for_grid((4, 3, 6), MERGE, 0.5)
