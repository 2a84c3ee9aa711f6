"""EVS (Efficient Video Sampling): drop video tokens that barely change between frames.

The rule is vLLM's (vllm/multimodal/evs.py): score each merged video token by
1 - cosine similarity with the token at the same spatial position one temporal patch
earlier; the first temporal patch always stays (it scores above any possible
dissimilarity, which is at most 2); keep the global top-k by score with a stable sort, where
k = max(tokens per frame, int(T * tokens per frame * (1 - rate))) depends only on the grid
and the rate, so placeholders can be sized before the vision encoder runs. Kept tokens keep
their original (t, h, w) M-RoPE positions.

Shapes: `grid_thw` is the processor's *patch* grid (t, h, w); the language model sees
t * (h / m) * (w / m) merged tokens, ordered (t, h/m, w/m) row-major.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Above any 1 - cos (at most 2), so the first frame wins every comparison.
_FIRST_FRAME_SCORE = 255.0


def check_pruning_rate(rate: float) -> float:
    """`video_pruning_rate` as a float in [0, 1); ValueError naming the value otherwise."""
    value = float(rate)
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"video_pruning_rate={rate!r} is outside [0, 1): 0 keeps every video token, "
            "0.75 drops three quarters of them (1 would drop them all)"
        )
    return value


def _merged_grid(grid_thw: Sequence[int] | torch.Tensor, merge: int) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in grid_thw)
    if h % merge or w % merge:
        raise ValueError(
            f"video grid {(t, h, w)}: height and width must be multiples of "
            f"spatial_merge_size={merge}"
        )
    return t, h // merge, w // merge


def compute_retained_tokens_count(tokens_per_frame: int, num_frames: int, rate: float) -> int:
    """Tokens EVS keeps for `num_frames` temporal patches of `tokens_per_frame` merged tokens:
    never fewer than one whole frame."""
    rate = check_pruning_rate(rate)
    return max(tokens_per_frame, int(tokens_per_frame * num_frames * (1 - rate)))


def retained_tokens_for_grid(
    grid_thw: Sequence[int] | torch.Tensor, spatial_merge_size: int, rate: float
) -> int:
    """The placeholder count of one video with patch grid (t, h, w) at this pruning rate."""
    t, h, w = _merged_grid(grid_thw, spatial_merge_size)
    return compute_retained_tokens_count(h * w, t, rate)


def compute_retention_mask(
    video_embeds: torch.Tensor,
    grid_thw: Sequence[int] | torch.Tensor,
    spatial_merge_size: int,
    rate: float,
) -> torch.Tensor:
    """Bool mask over the video's merged tokens [t*h'*w'], True where the token is kept;
    exactly `retained_tokens_for_grid(...)` entries are True.

    Similarity is computed in float32 whatever the embedding dtype: in bf16 many scores tie
    and the kept set would depend on rounding more than on motion.
    """
    t, h, w = _merged_grid(grid_thw, spatial_merge_size)
    if video_embeds.dim() != 2 or video_embeds.shape[0] != t * h * w:
        raise ValueError(
            f"video embeddings of shape {list(video_embeds.shape)} do not match grid "
            f"{tuple(int(x) for x in grid_thw)}: expected [{t * h * w}, hidden]"
        )
    frames = video_embeds.float().view(t, h, w, -1)
    dissimilarity = 1 - F.cosine_similarity(frames[1:], frames[:-1], dim=-1)
    first = torch.full_like(frames[:1, :, :, 0], _FIRST_FRAME_SCORE)
    scores = torch.cat([first, dissimilarity]).flatten()
    keep = compute_retained_tokens_count(h * w, t, rate)
    order = torch.argsort(scores, descending=True, stable=True)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[order[:keep]] = True
    return mask


def video_mrope_positions(
    grid_thw: Sequence[int] | torch.Tensor, spatial_merge_size: int, time_interval: float = 1.0
) -> torch.Tensor:
    """M-RoPE (t, h, w) positions [3, t*h'*w'] of a video's merged tokens, relative to the
    media's start position (add it to all three rows). The temporal index of temporal patch
    i is int(i * time_interval), with time_interval = tokens_per_second * seconds per
    temporal patch (1 for images), as in HF's Qwen2.5-VL."""
    t, h, w = _merged_grid(grid_thw, spatial_merge_size)
    temporal = (torch.arange(t) * time_interval).long()
    grid = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([axis.flatten() for axis in grid])


@dataclass(frozen=True)
class PrunedVideo:
    """What EVS hands the language model for one video."""

    embeds: torch.Tensor  # [kept, hidden], in the original token order
    positions: torch.Tensor  # [3, kept] relative M-RoPE positions of the kept tokens
    mask: torch.Tensor  # [t*h'*w'] bool over the unpruned tokens


def prune_video(
    video_embeds: torch.Tensor,
    grid_thw: Sequence[int] | torch.Tensor,
    spatial_merge_size: int,
    rate: float,
    time_interval: float = 1.0,
) -> PrunedVideo:
    """Apply EVS to one video's merged embeddings; rate 0 keeps everything unchanged."""
    mask = compute_retention_mask(video_embeds, grid_thw, spatial_merge_size, rate)
    positions = video_mrope_positions(grid_thw, spatial_merge_size, time_interval)
    return PrunedVideo(
        embeds=video_embeds[mask.to(video_embeds.device)],
        positions=positions[:, mask.cpu()],
        mask=mask,
    )
