"""Logprobs of chosen tokens plus the top-N alternatives, from raw model logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    """Per-row logprobs, one row per sampled (or given) token.

    - `token_ids`: [N, 1 + k] int64; column 0 is the sampled/given token, then the top-k ids
      in order of decreasing logprob (order among equal logprobs is unspecified).
    - `logprobs`: [N, 1 + k] float32, matching `token_ids`.
    - `ranks`: [N] int64; rank of column 0's token, 1 = most likely. Equal logprobs share a
      rank: it is 1 + the number of tokens with a strictly greater logprob.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def slice_rows(self, start: int, end: int) -> LogprobsTensors:
        """Rows [start, end), e.g. one request's share of a prompt-logprobs batch."""
        return LogprobsTensors(
            self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Pick each row's logprob for `token_ids` [N] and its top `num_logprobs` alternatives."""
    token_ids = token_ids.to(torch.long).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=1) + 1
    num_logprobs = min(num_logprobs, logprobs.shape[1])
    if num_logprobs > 0:
        top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=token_logprobs, ranks=ranks)


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprob and rank of given tokens (e.g. each prompt position's next token) plus top-N.

    `logits` [N, V] are raw model logits; `token_ids` [N] the tokens to score.
    """
    return gather_logprobs(compute_logprobs(logits), token_ids, num_logprobs)
