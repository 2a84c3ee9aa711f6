"""Driving a lone Mamba2Mixer through packed steps (no transformers import: the Triton
interpreter tests use it too)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.attention.recurrent import RecurrentMetadata
from tinyvllm.models.layers.mamba2 import Mamba2Mixer


def step_metadata(
    bounds: Sequence[int], slots: Sequence[int], carried: Sequence[bool]
) -> AttentionMetadata:
    """The metadata the runner hands a packed step (only what a mixer reads is meaningful)."""
    num = len(slots)
    query_lens = [bounds[i + 1] - bounds[i] for i in range(num)]
    return AttentionMetadata(
        num_reqs=num,
        num_actual_tokens=bounds[-1],
        query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32),
        block_table=torch.zeros(num, 1, dtype=torch.int32),
        slot_mapping=torch.full((bounds[-1],), -1, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
        query_start_loc_cpu=list(bounds),
        seq_lens_cpu=query_lens,
        block_size=16,
        recurrent=RecurrentMetadata.build(
            list(slots), list(carried), query_lens, torch.device("cpu")
        ),
    )


def run(
    mixer: Mamba2Mixer,
    parts: Sequence[torch.Tensor],
    slots: Sequence[int],
    carried: Sequence[bool],
) -> list[torch.Tensor]:
    """One packed step over `parts` (one [L_i, hidden] tensor per sequence)."""
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + part.shape[0])
    with torch.no_grad():
        out = mixer(torch.cat(list(parts)), step_metadata(bounds, slots, carried))
    return [out[bounds[i] : bounds[i + 1]] for i in range(len(parts))]
