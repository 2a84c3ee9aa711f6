"""Logit edits that can change the argmax: min_tokens masking and repetition-style penalties.

Both return new tensors and never write into the logits they are given, because the sampler
still needs the raw logits afterwards for logprobs.
"""

from __future__ import annotations

import torch

from tinyvllm.sample.metadata import SamplingMetadata


def apply_min_tokens_mask(
    logits: torch.Tensor, min_tokens_mask: list[tuple[int, list[int]]]
) -> torch.Tensor:
    """Forbid (set to -inf) the stop tokens of rows that have not reached `min_tokens`."""
    rows: list[int] = []
    cols: list[int] = []
    for row, token_ids in min_tokens_mask:
        rows.extend([row] * len(token_ids))
        cols.extend(token_ids)
    if not rows:
        return logits
    # One host->device copy and one scatter for the whole batch, not one per row.
    index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
    value = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((index[0], index[1]), value)


def _ids(token_ids: torch.Tensor | None) -> torch.Tensor | None:
    if token_ids is None or token_ids.shape[1] == 0:
        return None
    return token_ids.to(torch.long)


def _occurrences(token_ids: torch.Tensor) -> torch.Tensor:
    """For each position of [B, L] ids, how often its id occurs in its row (no [B, V] buffer)."""
    sorted_ids = token_ids.sort(dim=1).values
    upper = torch.searchsorted(sorted_ids, token_ids, right=True)
    return upper - torch.searchsorted(sorted_ids, token_ids)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition (prompt + output), then frequency and presence (output only).

    Only the penalised (row, token) pairs are touched, via gather/scatter over the [B, P + O]
    id lists, so the cost beyond one copy of the logits does not scale with the vocabulary.
    Repeated ids are harmless: every copy of an id scatters the same value.
    """
    repetition = metadata.repetition_penalty
    frequency, presence = metadata.frequency_penalty, metadata.presence_penalty
    output_ids = _ids(metadata.output_token_ids)
    prompt_ids = _ids(metadata.prompt_token_ids) if repetition is not None else None
    if repetition is None and (output_ids is None or (frequency is None and presence is None)):
        return logits
    if prompt_ids is None and output_ids is None:
        return logits
    # An extra column absorbs the padding id (= vocab_size), so no masks are needed; it also
    # makes the copy that keeps the caller's logits untouched.
    vocab_size = logits.shape[1]
    work = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)

    if repetition is not None:
        penalty = repetition.to(logits.dtype).unsqueeze(1)
        # Gather every list from the unpenalised values first, so a token that is in both the
        # prompt and the output is penalised once.
        id_lists = [ids for ids in (prompt_ids, output_ids) if ids is not None]
        originals = [work.gather(1, ids) for ids in id_lists]
        for ids, values in zip(id_lists, originals, strict=True):
            # Divide rather than multiply by a reciprocal so results match HF bit for bit.
            work.scatter_(1, ids, torch.where(values > 0, values / penalty, values * penalty))

    if output_ids is not None and (frequency is not None or presence is not None):
        values = work.gather(1, output_ids)
        if frequency is not None:
            counts = _occurrences(output_ids).to(logits.dtype)
            values = values - frequency.to(logits.dtype).unsqueeze(1) * counts
        if presence is not None:
            values = values - presence.to(logits.dtype).unsqueeze(1)
        work.scatter_(1, output_ids, values)
    return work[:, :vocab_size]
