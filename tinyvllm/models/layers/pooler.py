"""Pooling the hidden states of a packed batch: one vector per request (or all its rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, lengths: list[int], kind: str) -> torch.Tensor:
    """[num_requests, hidden] from `hidden` [T, hidden], whose rows are the requests' tokens
    one request after another (`lengths` of them each): "CLS" a request's first row, "LAST"
    its last, "MEAN" the mean of its rows (summed in fp32, so long prompts lose nothing)."""
    ends = torch.tensor(lengths, device=hidden.device).cumsum(0)
    if kind == "CLS":
        return hidden[ends - ends.new_tensor(lengths)]
    if kind == "LAST":
        return hidden[ends - 1]
    if kind != "MEAN":
        raise ValueError(f"unknown pooling type {kind!r}; expected MEAN, CLS or LAST")
    counts = ends.new_tensor(lengths)
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), counts)
    sums = torch.zeros(len(lengths), hidden.shape[1], device=hidden.device)
    sums.index_add_(0, owner, hidden.float())
    return (sums / counts.unsqueeze(1)).to(hidden.dtype)


def normalize_rows(x: torch.Tensor, which: list[bool]) -> torch.Tensor:
    """L2-normalize the rows of `x` whose flag is set (in fp32), leaving the others."""
    if not any(which):
        return x
    if all(which):
        return F.normalize(x.float(), p=2, dim=-1).to(x.dtype)
    out = x.clone()
    rows = torch.tensor(which, device=x.device)
    out[rows] = F.normalize(x[rows].float(), p=2, dim=-1).to(x.dtype)
    return out
