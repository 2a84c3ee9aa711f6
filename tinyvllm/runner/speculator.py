"""The runner's side of speculative decoding: drafts into the rows, verification of a step's
K + 1 logits per request, and proposals for the next step.

The scheduler hands each request's drafts back with its next step (`scheduled_spec_decode_
tokens`); they are written into the request's row just past its known tokens, so input
preparation gathers them like any other token and the target scores all K + 1 positions in
one forward. Rejected drafts leave KV in slots past the request's computed length, which the
next step overwrites before anything reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tinyvllm.attention.backend import AttentionBackend
from tinyvllm.runner.draft_model import DraftModelProposer
from tinyvllm.runner.sampling import build_sampling_metadata, logprobs_to_lists
from tinyvllm.runner.states import RequestStates
from tinyvllm.spec_decode import (
    KController,
    NgramProposer,
    RejectionSampler,
    SpeculativeConfig,
    max_draft_tokens,
)

LogprobEntry = tuple[list[int], list[float], int]


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per sampling request: accepted drafts + one target token
    logprobs: list[list[LogprobEntry | None]] | None


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        draft: DraftModelProposer | None = None,
        backend: AttentionBackend | None = None,
        device: torch.device | None = None,
    ) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("a draft model proposer is needed exactly for method 'draft_model'")
        self.config = config
        self.draft = draft
        self.backend = backend
        self.device = device
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            config.prompt_lookup_min or 5,
            config.prompt_lookup_max or 5,
            config.num_speculative_tokens,
        )
        self.controller = KController(config)
        self.rejection_sampler = RejectionSampler()
        self.current_k = 0  # the K chosen for the latest proposals (for stats)
        self._last_propose: float | None = None

    @staticmethod
    def write_drafts(states: RequestStates, drafts: dict[str, list[int]]) -> None:
        for req_id, tokens in drafts.items():
            row = states.req_id_to_row[req_id]
            start = int(states.num_tokens[row])
            states.token_ids[row, start : start + len(tokens)] = torch.tensor(tokens)

    @staticmethod
    def logits_indices(
        query_end: torch.Tensor, num_drafts: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """Flattened token indices of each sampling request's last K_i + 1 positions."""
        counts = num_drafts + 1
        starts = query_end - counts
        offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        return (torch.repeat_interleave(starts, counts) + offsets).to(device)

    def verify(
        self,
        states: RequestStates,
        rows: torch.Tensor,
        logits: torch.Tensor,
        drafts: list[list[int]],
        generator: torch.Generator,
    ) -> VerifyResult:
        """Accept or reject each request's drafts against `logits` [sum(K_i + 1), V] and
        append the emitted tokens to the rows."""
        metadata = build_sampling_metadata(states, rows, generator)
        row_list = rows.tolist()
        seeds: dict[int, tuple[int, int]] = {}
        for i, row in enumerate(row_list):
            seed = states.seed[row]
            if seed is not None:
                seeds[i] = (seed, int(states.num_tokens[row] - states.num_prompt_tokens[row]))
        flat = [t for d in drafts for t in d]
        out = self.rejection_sampler(
            logits,
            torch.tensor(flat, dtype=torch.int64, device=logits.device),
            [len(d) for d in drafts],
            metadata,
            seeds=seeds,
        )
        self._append(states, rows, out.padded_token_ids.cpu())
        logprobs = None
        if out.logprobs is not None:
            per_token = logprobs_to_lists(
                out.logprobs,
                [
                    states.num_logprobs[row]
                    for row, t in zip(row_list, out.token_ids, strict=True)
                    for _ in t
                ],
            )
            logprobs, k = [], 0
            for tokens in out.token_ids:
                logprobs.append(per_token[k : k + len(tokens)])
                k += len(tokens)
        drafted = sum(len(d) for d in drafts)
        accepted = sum(out.num_accepted)
        rejected = sum(1 for d, a in zip(drafts, out.num_accepted, strict=True) if a < len(d))
        if drafted:
            self.controller.observe(drafted, accepted, rejected)
        return VerifyResult(out.token_ids, logprobs)

    @staticmethod
    def _append(states: RequestStates, rows: torch.Tensor, padded: torch.Tensor) -> None:
        valid = padded >= 0
        counts = valid.sum(dim=1)
        pos = states.num_tokens[rows].unsqueeze(1) + torch.arange(padded.shape[1])
        row_grid = rows.unsqueeze(1).expand_as(padded)
        states.token_ids[row_grid[valid], pos[valid]] = padded[valid]
        states.num_tokens[rows] += counts

    def propose(
        self, states: RequestStates, req_ids: list[str], rows: torch.Tensor
    ) -> dict[str, list[int]]:
        """Drafts for the next step of every request that just sampled (n-gram lookup over
        its own prompt and output)."""
        if not req_ids:
            return {}
        # The time from one proposal to the next is what a step with that K cost (verify,
        # drafting, sampling and engine overhead included).
        now = time.perf_counter()
        if self._last_propose is not None:
            elapsed = now - self._last_propose
            self.controller.observe_step_time(self.current_k, len(req_ids), elapsed)
        self._last_propose = now
        k = self.current_k = self.controller.choose_k(len(req_ids))
        if k == 0:
            return {}
        lengths = states.num_tokens[rows]
        num_out = (lengths - states.num_prompt_tokens[rows]).tolist()
        row_list = rows.tolist()
        ks = [
            min(
                max_draft_tokens(k, n, states.min_tokens[row]),
                self.max_model_len - int(length),
            )
            for row, n, length in zip(row_list, num_out, lengths.tolist(), strict=True)
        ]
        if not any(x > 0 for x in ks):
            return {}
        ks = [max(x, 0) for x in ks]
        if self.draft is not None:
            assert self.backend is not None and self.device is not None
            proposals = self.draft.propose(states, rows, ks, self.backend, self.device)
        else:
            width = int(lengths.max())
            proposals = self.proposer.propose(states.token_ids[rows, :width], ks, lengths=lengths)
        return {rid: p for rid, p in zip(req_ids, proposals, strict=True) if p}
