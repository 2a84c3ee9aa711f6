"""N-gram (prompt lookup) drafts: continue the text the way it continued last time.

For each request, find the most recent earlier occurrence of its last n tokens (the longest n in
[prompt_lookup_min, prompt_lookup_max] that occurs) and propose the tokens that followed it.
vLLM's proposer takes the earliest occurrence instead; `prefer_earliest=True` does the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class NgramProposer:
    """Batched n-gram matching on a padded token buffer; no Python loop over positions.

    Cost per call is O(B * L * prompt_lookup_max) elementwise tensor work for a [B, L] buffer.
    """

    def __init__(
        self,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        num_speculative_tokens: int,
        prefer_earliest: bool = False,
    ) -> None:
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be at least 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max={prompt_lookup_max} must be at least "
                f"prompt_lookup_min={prompt_lookup_min}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens
        self.prefer_earliest = prefer_earliest

    def propose(
        self,
        token_ids: torch.Tensor | Sequence[torch.Tensor],
        k_per_request: int | Sequence[int] | None = None,
        lengths: torch.Tensor | Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Up to K_i draft tokens per request; an empty list where nothing matches.

        `token_ids` is a list of 1-D tensors (each request's prompt + output tokens) or a padded
        [B, L] tensor with `lengths` (all L when omitted). `k_per_request` caps each request's
        drafts (an int for all; default `num_speculative_tokens`); larger values are clamped to
        `num_speculative_tokens`.
        """
        drafts, num = self.propose_tensors(token_ids, k_per_request, lengths)
        return [row[:n] for row, n in zip(drafts.tolist(), num.tolist(), strict=True)]

    def propose_tensors(
        self,
        token_ids: torch.Tensor | Sequence[torch.Tensor],
        k_per_request: int | Sequence[int] | None = None,
        lengths: torch.Tensor | Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `propose`: ([B, max K] int64 drafts padded with -1, [B] draft counts)."""
        tokens, lengths_t = _as_padded(token_ids, lengths)
        batch, width = tokens.shape
        device = tokens.device
        ks = _per_request_k(k_per_request, batch, self.num_speculative_tokens, device)
        max_k = int(ks.max()) if batch else 0
        # An earlier occurrence with a token after it needs at least two tokens.
        if batch == 0 or max_k == 0 or width < 2:
            return torch.full((batch, max_k), -1, dtype=torch.long, device=device), ks * 0
        best_end = self._match_ends(tokens, lengths_t)

        # The proposal is what followed the match, cut at the end of the sequence.
        found = best_end >= 0
        num = torch.where(found, torch.minimum(ks, lengths_t - best_end), 0)
        j = torch.arange(max_k, device=device)
        index = (best_end.unsqueeze(1) + j).clamp(0, width - 1)
        drafts = torch.where(j < num.unsqueeze(1), tokens.gather(1, index).long(), -1)
        return drafts, num

    def _match_ends(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B] end (exclusive) of the chosen earlier occurrence of the suffix, -1 if none.

        `run[b, e]` says whether the n tokens ending before e equal the row's last n tokens;
        growing n by one only adds one shifted comparison, so all n share one [B, L] pass each.
        An occurrence counts if it ends at e <= length - 1, so it is not the suffix itself and
        at least one token follows it. Longer n overwrites shorter; within one n the largest e
        (most recent) wins, or the smallest with `prefer_earliest`.
        """
        batch, width = tokens.shape
        ends = torch.arange(width, device=tokens.device)
        before_end = ends < lengths.unsqueeze(1)
        run = torch.ones(batch, width, dtype=torch.bool, device=tokens.device)
        best_end = torch.full((batch,), -1, dtype=torch.long, device=tokens.device)
        for n in range(1, min(self.prompt_lookup_max, width - 1) + 1):
            last = tokens.gather(1, (lengths - n).clamp(min=0).unsqueeze(1))
            run[:, n:] &= tokens[:, : width - n] == last
            run[:, n - 1] = False  # fewer than n tokens end there
            if n < self.prompt_lookup_min:
                continue
            # Rows shorter than n + 1 have no valid end: e >= n and e <= length - 1.
            valid = run & before_end
            if self.prefer_earliest:
                candidates = torch.where(valid, ends, width).amin(dim=1)
                candidates = torch.where(candidates < width, candidates, -1)
            else:
                candidates = torch.where(valid, ends, -1).amax(dim=1)
            best_end = torch.where(candidates >= 0, candidates, best_end)
        return best_end


def _as_padded(
    token_ids: torch.Tensor | Sequence[torch.Tensor],
    lengths: torch.Tensor | Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be [B, L], got {tuple(token_ids.shape)}")
        batch, width = token_ids.shape
        if lengths is None:
            lengths_t = torch.full((batch,), width, dtype=torch.long, device=token_ids.device)
        else:
            lengths_t = torch.as_tensor(lengths, dtype=torch.long).to(token_ids.device)
            if lengths_t.shape != (batch,):
                raise ValueError(f"lengths must have {batch} entries, got {tuple(lengths_t.shape)}")
            if batch and (int(lengths_t.min()) < 0 or int(lengths_t.max()) > width):
                raise ValueError(f"lengths must lie in [0, {width}], got {lengths_t.tolist()}")
        return token_ids, lengths_t
    if lengths is not None:
        raise ValueError("lengths is only used with a padded [B, L] token_ids tensor")
    rows = [t.reshape(-1).long() for t in token_ids]
    device = rows[0].device if rows else torch.device("cpu")
    lengths_t = torch.tensor([r.numel() for r in rows], dtype=torch.long, device=device)
    if not rows:
        return torch.empty((0, 0), dtype=torch.long), lengths_t
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1), lengths_t


def _per_request_k(
    k_per_request: int | Sequence[int] | None, batch: int, limit: int, device: torch.device
) -> torch.Tensor:
    if k_per_request is None:
        k_per_request = limit
    if isinstance(k_per_request, int):
        ks = torch.full((batch,), k_per_request, dtype=torch.long, device=device)
    else:
        ks = torch.as_tensor(list(k_per_request), dtype=torch.long).to(device)
        if ks.shape != (batch,):
            raise ValueError(f"k_per_request must have {batch} entries, got {len(ks)}")
    return ks.clamp(0, limit)
