"""RecurrentLayer: a mixer layer that keeps a fixed-size state per request (short-conv window,
SSM state) instead of paged KV.

The runner allocates every state tensor once, `[num_slots, *shape]`, and binds them to
`states` before the first step; a request's state is one slot across all its layers. Per
forward, a layer reads the slot of each request (`AttentionMetadata.recurrent`), runs its
tokens and writes the state after its last token back into the same slot. Copies between
slots (prefix-cache snapshots and restores) are the runner's job, never the layer's.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateShape:
    """One state tensor of a layer, per slot (the runner adds the slot dimension in front)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


class RecurrentLayer(nn.Module):
    """Base of mixer layers with per-request recurrent state."""

    def __init__(self) -> None:
        super().__init__()
        # Bound by the runner: one tensor [num_slots, *shape] per state_shapes() entry.
        self.states: list[torch.Tensor] = []

    @abstractmethod
    def state_shapes(self) -> list[StateShape]:
        """The per-slot shape and dtype of each state tensor, in the order of `states`."""

    def set_ssm_state_dtype(self, dtype: torch.dtype) -> None:
        """Keep the SSM state in `dtype` (engine arg mamba_ssm_cache_dtype); call before the
        runner sizes the states. Layers without an SSM state (short convs) ignore it."""

    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state_shapes())
