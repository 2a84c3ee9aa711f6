"""InputBatch: one step's flattened model inputs, gathered from the persistent rows.

Everything per token is computed with tensor ops over the whole batch; Python only touches
one entry per request (its row index and scheduled token count). Host-side steps of one token
per request (decode) take the same arithmetic in numpy on the rows' numpy views: at a few
requests each torch op on a tiny tensor costs more than its work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.runner.states import RequestStates


@dataclass
class InputBatch:
    req_ids: list[str]
    rows: torch.Tensor  # [B] row of each request in RequestStates
    num_scheduled: torch.Tensor  # [B]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    # Requests that sample this step (their scheduled tokens reach the end of what is known).
    sample_idx: torch.Tensor  # [S] batch index of each sampling request
    logits_indices: torch.Tensor  # [S] flattened token index whose logits are sampled
    # Python mirrors of `rows` and `sample_idx`, for the per-request loops after the forward.
    row_list: list[int]
    sample_list: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def prepare_inputs(
    states: RequestStates,
    req_ids: list[str],
    num_scheduled_tokens: list[int],
    block_size: int,
    device: torch.device,
    device_side: bool | None = None,
) -> InputBatch:
    """Flatten one step's requests. With `device_side` (default: on GPUs) the per-token
    positions and slot mapping are computed on the device from per-request values, so only
    O(requests) data crosses the bus besides the input ids."""
    if device_side is None:
        device_side = device.type == "cuda"
    row_list = [states.req_id_to_row[r] for r in req_ids]
    if not device_side and device.type == "cpu" and all(n == 1 for n in num_scheduled_tokens):
        return _prepare_decode(states, req_ids, row_list, block_size)
    num_reqs = len(req_ids)
    rows = torch.tensor(row_list, dtype=torch.int64)
    num_sched = torch.tensor(num_scheduled_tokens, dtype=torch.int64)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int64)
    torch.cumsum(num_sched, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), num_sched)
    row_of_token = rows[req_of_token]
    computed = states.num_computed_tokens[rows]
    positions = computed[req_of_token] + torch.arange(num_tokens) - query_start_loc[req_of_token]
    input_ids = states.token_ids[row_of_token, positions]

    seq_lens = computed + num_sched
    seq_lens_cpu = seq_lens.tolist()
    max_seq_len = max(seq_lens_cpu)
    max_blocks = -(-max_seq_len // block_size)
    block_table = states.block_table[rows, :max_blocks]
    if device_side:
        block_table_dev = block_table.to(device, non_blocking=True)
        positions_dev, slot_mapping = _device_positions_and_slots(
            computed, num_sched, query_start_loc, block_table_dev, num_tokens, block_size, device
        )
    else:
        block_table_dev = block_table
        block_ids = states.block_table[row_of_token, positions // block_size].to(torch.int64)
        slot_mapping = block_ids * block_size + positions % block_size
        positions_dev = positions

    samples = seq_lens >= states.num_tokens[rows]
    sample_idx = torch.nonzero(samples).flatten()
    logits_indices = query_start_loc[1:][sample_idx] - 1

    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        block_table=block_table_dev.to(device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=int(num_sched.max()),
        max_seq_len=max_seq_len,
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens_cpu,
        block_size=block_size,
    )
    return _batch(
        req_ids,
        row_list,
        (rows, num_sched, input_ids.to(device), positions_dev.to(device)),
        metadata,
        sample_idx,
        logits_indices.to(device),
    )


def _batch(
    req_ids: list[str],
    row_list: list[int],
    per_token: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    sample_idx: torch.Tensor,
    logits_indices: torch.Tensor,
) -> InputBatch:
    """The InputBatch of either path; `per_token` is (rows, num_scheduled, input_ids,
    positions)."""
    rows, num_sched, input_ids, positions = per_token
    return InputBatch(
        req_ids=req_ids,
        rows=rows,
        num_scheduled=num_sched,
        input_ids=input_ids,
        positions=positions,
        attn_metadata=metadata,
        sample_idx=sample_idx,
        logits_indices=logits_indices,
        row_list=row_list,
        sample_list=sample_idx.tolist(),
    )


def _prepare_decode(
    states: RequestStates, req_ids: list[str], row_list: list[int], block_size: int
) -> InputBatch:
    """`prepare_inputs` of a CPU step that schedules one token per request: the general
    path's values (dtypes and contiguity included). Request i's token is its token at position
    num_computed, and it is token i of the flat batch.

    Why scalar reads of the rows' numpy views rather than tensor ops: a decode step's time
    outside the model is mostly cache misses (the weights have just streamed through the
    caches), which grow with the variety of code a step runs more than with its amount; a few
    reads per request and one kind of array constructor touch far less than ~30 torch ops."""
    computed, token_ids, num_tokens = (
        states.np_num_computed_tokens,
        states.np_token_ids,
        states.np_num_tokens,
    )
    table = states.np_block_table
    positions: list[int] = []
    input_ids: list[int] = []
    slots: list[int] = []
    sample_list: list[int] = []
    for i, row in enumerate(row_list):
        pos = int(computed[row])
        positions.append(pos)
        input_ids.append(int(token_ids[row, pos]))
        slots.append(int(table[row, pos // block_size]) * block_size + pos % block_size)
        # The last known token samples; a one-token prompt chunk short of the prompt's end
        # does not.
        if pos + 1 >= num_tokens[row]:
            sample_list.append(i)
    num_reqs = len(row_list)
    seq_lens_cpu = [pos + 1 for pos in positions]
    max_seq_len = max(seq_lens_cpu)
    block_table = np.ascontiguousarray(table[row_list, : -(-max_seq_len // block_size)])
    query_start_loc_cpu = list(range(num_reqs + 1))
    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        query_start_loc=_tensor(query_start_loc_cpu, np.int32),
        seq_lens=_tensor(seq_lens_cpu, np.int32),
        block_table=torch.from_numpy(block_table),
        slot_mapping=_tensor(slots, np.int64),
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
        block_size=block_size,
    )
    per_token = (
        _tensor(row_list, np.int64),
        _tensor([1] * num_reqs, np.int64),
        _tensor(input_ids, np.int64),
        _tensor(positions, np.int64),
    )
    # Token i is request i's: the sampled tokens' flat indices are the requests'.
    sample_idx, logits_indices = _tensor(sample_list, np.int64), _tensor(sample_list, np.int64)
    return _batch(req_ids, row_list, per_token, metadata, sample_idx, logits_indices)


def _tensor(values: list[int], dtype: type[np.integer]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=dtype))


def _device_positions_and_slots(
    computed: torch.Tensor,
    num_sched: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token positions and KV slots from per-request values, computed where they are used.

    `block_table` is already on `device` (the attention kernels need it anyway)."""
    num_reqs = computed.shape[0]
    computed = computed.to(device, non_blocking=True)
    qsl = query_start_loc.to(device, non_blocking=True)
    counts = num_sched.to(device, non_blocking=True)
    req = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), counts, output_size=num_tokens
    )
    positions = computed[req] + torch.arange(num_tokens, device=device) - qsl[req]
    block_ids = block_table[req, positions // block_size].to(torch.int64)
    return positions, block_ids * block_size + positions % block_size
