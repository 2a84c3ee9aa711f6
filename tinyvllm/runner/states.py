"""RequestStates: persistent per-request rows that live across steps.

A request gets a row when it is first scheduled and keeps it until it finishes or is preempted,
so each step only writes what changed (new blocks, sampled tokens) instead of rebuilding the
batch from Python objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tinyvllm.core.outputs import NewRequestData

if TYPE_CHECKING:
    from tinyvllm.sample.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5


class RequestStates:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.req_id_to_row: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

        self.token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int64)
        self.num_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.num_prompt_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        self.num_blocks = [0] * max_num_reqs
        # numpy views of the same memory, for the per-step reads and writes of a few rows:
        # a numpy index costs ~0.5 us against ~2-5 us for a torch op on a tiny tensor, and a
        # decode step makes a dozen of them (prepare_inputs' decode path, the runner's
        # bookkeeping). The tensors are never replaced, so the views stay valid.
        self.np_token_ids = self.token_ids.numpy()
        self.np_num_tokens = self.num_tokens.numpy()
        self.np_num_computed_tokens = self.num_computed_tokens.numpy()
        self.np_block_table = self.block_table.numpy()

        # Sampling parameters as columns, gathered per step by row index.
        self.temperature = torch.ones(max_num_reqs, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32)
        self.min_p = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.repetition_penalty = torch.ones(max_num_reqs, dtype=torch.float32)
        self.presence_penalty = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.frequency_penalty = torch.zeros(max_num_reqs, dtype=torch.float32)
        # Python-side per-row facts the sampler reads only for the rows that need them.
        self.seed: list[int | None] = [None] * max_num_reqs
        self.num_logprobs: list[int | None] = [None] * max_num_reqs
        self.num_prompt_logprobs: list[int | None] = [None] * max_num_reqs
        self.min_tokens: list[int] = [0] * max_num_reqs
        self.min_tokens_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        # Bumped whenever a row's sampling columns change (a request takes the row): the
        # sampling metadata of the last step can be reused while the sampled rows and this
        # stay the same (see runner/sampling.py).
        self.sampling_version = 0
        self.last_sampling: tuple[tuple[int, ...], int, SamplingMetadata] | None = None

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add(self, new: NewRequestData) -> int:
        """Give `new` a row. Raises (with no row taken) if a value does not fit its column."""
        if not self.free_rows:
            raise RuntimeError("more concurrent requests than max_num_seqs")
        row = self.free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        try:
            self._fill(row, new)
        except BaseException:
            self.remove(new.req_id)
            raise
        return row

    def _fill(self, row: int, new: NewRequestData) -> None:
        self.sampling_version += 1  # first: a fill that fails halfway changed columns too
        tokens = new.prompt_token_ids + new.output_token_ids
        n = len(tokens)
        self.token_ids[row, :n] = torch.tensor(tokens, dtype=torch.int64)
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)

        p = new.sampling_params
        greedy = p.temperature < _GREEDY_EPS
        self.temperature[row] = 0.0 if greedy else p.temperature
        self.top_k[row] = 0 if greedy else p.top_k
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.seed[row] = p.seed
        self.num_logprobs[row] = p.logprobs
        self.num_prompt_logprobs[row] = p.prompt_logprobs
        self.min_tokens[row] = p.min_tokens
        # Ids past the vocabulary can never be sampled, so there is nothing to forbid (and they
        # would index past the logits).
        stop_ids = p.stop_ids(new.eos_token_id) if p.min_tokens else set()
        self.min_tokens_ids[row] = sorted(t for t in stop_ids if t < self.vocab_size)

    def append_prompt_tokens(self, row: int, token_ids: list[int]) -> None:
        """Streaming input: prompt tokens that arrived after the row was filled. They come
        before any output (the scheduler holds a streaming prompt's last token back)."""
        n = int(self.num_tokens[row])
        if n != int(self.num_prompt_tokens[row]):
            raise RuntimeError("prompt tokens cannot be appended after output tokens")
        end = n + len(token_ids)
        self.token_ids[row, n:end] = torch.tensor(token_ids, dtype=torch.int64)
        self.num_tokens[row] = end
        self.num_prompt_tokens[row] = end

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        self.np_block_table[row, start:end] = block_ids
        self.num_blocks[row] = end
