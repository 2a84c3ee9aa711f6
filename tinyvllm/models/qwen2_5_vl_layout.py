"""Where each patch of a Qwen2.5-VL vision forward goes: window order, attention segments.

Derived from `grid_thw` alone. Patches of one item arrive ordered (t, h/m, w/m, m, m), so each
run of m*m consecutive patches is one merged token; windowed blocks attend inside windows of
merged tokens, which are permuted into window order so every window is a contiguous run, and
full-attention blocks attend within one temporal patch (frame pair) of one item.
`varlen_attention` runs bidirectional attention inside such segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class VisionLayout:
    """Index bookkeeping for one forward call, derived from `grid_thw` alone.

    `window_index[i]` is the merged token (in input order) placed at position i of the
    window order; `window_seqlens` / `frame_seqlens` are the patch counts of the attention
    segments of the windowed and the full-attention blocks, in window order. `positions`
    holds each patch's (row, column) on its frame's patch grid, in window order.
    """

    window_index: torch.Tensor
    window_seqlens: list[int]
    frame_seqlens: list[int]
    positions: torch.Tensor

    def chunks(self, full: bool, chunk_rows: int | None) -> list[tuple[int, int, list[int]]]:
        """Runs of whole segments of the windowed (or, with `full`, the full-attention)
        blocks; see `row_chunks`."""
        return row_chunks(self.frame_seqlens if full else self.window_seqlens, chunk_rows)


def row_chunks(seqlens: list[int], chunk_rows: int | None) -> list[tuple[int, int, list[int]]]:
    """(first row, end row, segment lengths) of consecutive segments grouped greedily into
    runs of at most `chunk_rows` rows (a longer segment is a run of its own); None: one run."""
    if chunk_rows is None:
        return [(0, sum(seqlens), list(seqlens))]
    runs: list[tuple[int, int, list[int]]] = []
    start = end = 0
    current: list[int] = []
    for length in seqlens:
        if current and end + length - start > chunk_rows:
            runs.append((start, end, current))
            start, current = end, []
        current.append(length)
        end += length
    if current:
        runs.append((start, end, current))
    return runs


def _item_windows(
    t: int, h: int, w: int, window: int, offset: int
) -> tuple[torch.Tensor, list[int]]:
    """Window order of one item's merged tokens (grid t x h x w) and its window sizes."""
    ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    windows_h, windows_w = -(-h // window), -(-w // window)
    window_id = (ti * windows_h + hi // window) * windows_w + wi // window
    # Windows in row-major order per frame, tokens in row-major order inside each window.
    key = (window_id * window + hi % window) * window + wi % window
    order = torch.argsort(key.flatten())
    counts = torch.bincount(window_id.flatten(), minlength=t * windows_h * windows_w)
    return order + offset, counts[counts > 0].tolist()


def _item_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(row, column) of each patch of one item, in the processor's (t, h/m, w/m, m, m) order."""
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    frame = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    return frame.repeat(t, 1)


def vision_layout(
    grid_thw: torch.Tensor, merge: int, window: int, device: torch.device | None = None
) -> VisionLayout:
    """Build the permutation and attention segments for items with patch grids `grid_thw`.

    `window` is the window side in merged tokens (`window_size // merge // patch_size`).
    """
    unit = merge * merge
    window_index: list[torch.Tensor] = []
    window_seqlens: list[int] = []
    frame_seqlens: list[int] = []
    positions: list[torch.Tensor] = []
    offset = 0
    for t, h, w in grid_thw.tolist():
        if h % merge or w % merge:
            raise ValueError(
                f"grid_thw item {(t, h, w)}: height and width must be multiples of "
                f"spatial_merge_size={merge} (use the Qwen-VL processor to build the inputs)"
            )
        order, counts = _item_windows(t, h // merge, w // merge, window, offset)
        window_index.append(order)
        window_seqlens.extend(count * unit for count in counts)
        frame_seqlens.extend([h * w] * t)
        positions.append(_item_positions(t, h, w, merge))
        offset += t * (h // merge) * (w // merge)
    index = torch.cat(window_index)
    # Reorder patches in whole merged-token units, like the hidden states.
    patch_positions = torch.cat(positions).view(-1, unit, 2)[index].view(-1, 2)
    return VisionLayout(
        window_index=index.to(device),
        window_seqlens=window_seqlens,
        frame_seqlens=frame_seqlens,
        positions=patch_positions.to(device),
    )


def _runs(seqlens: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal consecutive lengths: (first row, length, count)."""
    runs: list[tuple[int, int, int]] = []
    row = 0
    for length in seqlens:
        if runs and runs[-1][1] == length:
            first, _, count = runs[-1]
            runs[-1] = (first, length, count + 1)
        else:
            runs.append((row, length, 1))
        row += length
    return runs


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each segment; q/k/v [N, heads, head_dim] (rows may be
    strided) -> [N, heads * head_dim], contiguous.

    Segments of equal length are stacked into one batched 4-D SDPA call. Where each length
    forms one run of consecutive segments (a grid-aligned frame's windows, a video's frames)
    the batch is a view of q/k/v; otherwise (partial edge windows interleave two lengths)
    each length's rows are gathered, so a ~1k-patch image still costs a handful of calls.
    """
    n, heads, dim = q.shape
    runs = _runs(seqlens)
    if len(runs) == 1:  # the common case: no copy in, one copy out
        _, length, count = runs[0]
        qs, ks, vs = (x.view(count, length, heads, dim).transpose(1, 2) for x in (q, k, v))
        res = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        return res.transpose(1, 2).reshape(n, heads * dim)
    out = q.new_empty(n, heads, dim)
    if len(runs) == len(set(seqlens)):
        for first, length, count in runs:
            rows = slice(first, first + length * count)
            qs, ks, vs = (
                x[rows].view(count, length, heads, dim).transpose(1, 2) for x in (q, k, v)
            )
            res = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            out[rows] = res.transpose(1, 2).reshape(-1, heads, dim)
        return out.view(n, heads * dim)
    starts = torch.tensor([0, *seqlens[:-1]], dtype=torch.long).cumsum(0)
    lengths = torch.tensor(seqlens, dtype=torch.long)
    for length in torch.unique(lengths).tolist():
        first = starts[lengths == length].to(q.device)
        index = (first[:, None] + torch.arange(length, device=q.device)).flatten()
        shape = (first.numel(), length, heads, dim)
        qs, ks, vs = (x[index].view(shape).transpose(1, 2) for x in (q, k, v))
        res = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[index] = res.transpose(1, 2).reshape(-1, heads, dim)
    return out.view(n, heads * dim)
