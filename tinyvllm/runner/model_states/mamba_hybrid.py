"""MambaHybridModelState: models whose mixer layers keep recurrent state (LFM2 short
convolutions, Mamba2 SSMs) beside attention layers with paged KV.

The scheduler hands every running request a state slot (`NewRequestData.state_slot`; slots
are `core/state_pool.py`'s) and, on a prefix-cache hit, the snapshot slot its state resumes
from. This state fills the slot on admission (zeros, or a copy of the snapshot: the cached
snapshot itself is never written), tells the mixer layers each request's slot per forward
(`AttentionMetadata.recurrent`), and after the forward copies the state of requests whose
computed tokens now end on a block boundary into the snapshot slots the scheduler reserved
(`SchedulerOutput.state_snapshots`).
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata
from tinyvllm.attention.recurrent import RecurrentMetadata
from tinyvllm.core.outputs import NewRequestData, SchedulerOutput
from tinyvllm.models.layers.recurrent import RecurrentLayer
from tinyvllm.runner.input_batch import InputBatch
from tinyvllm.runner.model_states.interface import ModelInputs, ModelState


class MambaHybridModelState(ModelState):
    def __init__(self, model: nn.Module, max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, max_num_reqs, device)
        self.layers: list[RecurrentLayer] = model.recurrent_layers()  # type: ignore[operator]
        self.slot_of_row = [-1] * max_num_reqs
        self.req_of_row: list[str | None] = [None] * max_num_reqs
        self.slot_of_req: dict[str, int] = {}
        self._snapshots: dict[str, int] = {}

    def _tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.states]

    def begin_step(self, sched: SchedulerOutput) -> None:
        self._snapshots = sched.state_snapshots

    def add_request(self, row: int, new: NewRequestData) -> None:
        slot = new.state_slot
        if slot is None:
            raise RuntimeError(
                f"request {new.req_id!r} reached a hybrid model without a recurrent-state slot"
            )
        restore = new.restore_state_slot
        if restore is None and new.num_computed_tokens:
            raise RuntimeError(
                f"request {new.req_id!r} resumes at token {new.num_computed_tokens} without a "
                "state snapshot to resume from"
            )
        for tensor in self._tensors():
            if restore is None:
                tensor[slot].zero_()
            else:
                tensor[slot].copy_(tensor[restore])
        self.slot_of_row[row] = slot
        self.req_of_row[row] = new.req_id
        self.slot_of_req[new.req_id] = slot

    def remove_request(self, row: int) -> None:
        req_id = self.req_of_row[row]
        if req_id is not None:
            self.slot_of_req.pop(req_id, None)
        self.slot_of_row[row] = -1
        self.req_of_row[row] = None

    def model_inputs(self, batch: InputBatch) -> ModelInputs:
        md = batch.attn_metadata
        qsl = md.query_start_loc_cpu
        query_lens = [qsl[i + 1] - qsl[i] for i in range(batch.num_reqs)]
        has_initial = [s > n for s, n in zip(md.seq_lens_cpu, query_lens, strict=True)]
        slots = [self.slot_of_row[r] for r in batch.rows.tolist()]
        md.recurrent = RecurrentMetadata.build(slots, has_initial, query_lens, self.device)
        return ModelInputs(batch.input_ids, batch.positions, md)

    def dummy_inputs(self, metadata: AttentionMetadata) -> ModelInputs:
        positions = torch.arange(metadata.num_actual_tokens, device=self.device)
        qsl = metadata.query_start_loc_cpu
        lens = [qsl[i + 1] - qsl[i] for i in range(metadata.num_reqs)]
        metadata.recurrent = RecurrentMetadata.build(
            [0] * metadata.num_reqs, [False] * metadata.num_reqs, lens, self.device
        )
        return ModelInputs(torch.zeros_like(positions), positions, metadata)

    def post_forward(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        if not self._snapshots:
            return
        pairs = [
            (self.slot_of_req[rid], dst)
            for rid, dst in self._snapshots.items()
            if rid in self.slot_of_req
        ]
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for tensor in self._tensors():
            tensor[dst] = tensor[src]
        self._snapshots = {}
