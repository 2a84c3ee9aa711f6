"""RecurrentMetadata: what recurrent (mixer) layers read per forward, beside the attention
metadata (`AttentionMetadata.recurrent`).

Requests keep the flat batch order (not sorted decode-first); their tokens are
`query_start_loc[i]:query_start_loc[i + 1]`. A layer reads request i's initial state from slot
`state_indices[i]` (zeros when `has_initial_state[i]` is False: the runner zeroed the slot) and
writes the state after the request's last token back into that slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RecurrentMetadata:
    state_indices: torch.Tensor  # [num_reqs] int64 on the device: each request's state slot
    state_indices_cpu: list[int]
    # False: the request starts at its first token (its slot holds zeros).
    has_initial_state: torch.Tensor  # [num_reqs] bool on the device
    has_initial_state_cpu: list[bool]
    # Decode requests: one token, continuing a state (the recurrent update path).
    decode_indices: torch.Tensor  # [D] int64 on the device, batch indices
    decode_indices_cpu: list[int]
    # Everything else: chunks of prompts (the scan path), from zeros or from the slot's state.
    prefill_indices_cpu: list[int]

    @classmethod
    def build(
        cls,
        state_indices: list[int],
        has_initial_state: list[bool],
        query_lens: list[int],
        device: torch.device,
    ) -> RecurrentMetadata:
        decode = [
            i for i, (n, init) in enumerate(zip(query_lens, has_initial_state, strict=True))
            if n == 1 and init
        ]  # fmt: skip
        decode_set = set(decode)
        prefill = [i for i in range(len(query_lens)) if i not in decode_set]
        return cls(
            state_indices=torch.tensor(state_indices, dtype=torch.int64, device=device),
            state_indices_cpu=list(state_indices),
            has_initial_state=torch.tensor(has_initial_state, dtype=torch.bool, device=device),
            has_initial_state_cpu=list(has_initial_state),
            decode_indices=torch.tensor(decode, dtype=torch.int64, device=device),
            decode_indices_cpu=decode,
            prefill_indices_cpu=prefill,
        )
