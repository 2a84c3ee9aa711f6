"""Gathers the sampler's per-step inputs from the persistent rows; shapes its outputs."""

from __future__ import annotations

import math

import numpy as np
import torch

from tinyvllm.runner.states import RequestStates
from tinyvllm.sample.logprobs import LogprobsTensors
from tinyvllm.sample.metadata import SAMPLING_EPS, SamplingMetadata, step_seed
from tinyvllm.sample.sampler import argmax_rows


def build_sampling_metadata(
    states: RequestStates, rows: torch.Tensor, default_generator: torch.Generator
) -> SamplingMetadata:
    """The sampler's inputs for `rows` (one per logits row).

    Decode steps sample the same rows step after step; unless a row has per-step inputs
    (penalties' token lists, a seed's generator, a min_tokens mask) the metadata is then the
    same as last step's and is reused rather than gathered again (~0.1 ms of tiny tensor ops).
    """
    key = tuple(rows.tolist())
    last = states.last_sampling
    if (
        last is not None
        and last[0] == key
        and last[1] == states.sampling_version
        and last[2].default_generator is default_generator
    ):
        return last[2]
    metadata = _gather_sampling_metadata(states, rows, default_generator)
    per_step = metadata.output_token_ids is not None or any(
        states.seed[r] is not None or states.min_tokens_ids[r] for r in key
    )
    states.last_sampling = None if per_step else (key, states.sampling_version, metadata)
    return metadata


def _gather_sampling_metadata(
    states: RequestStates, rows: torch.Tensor, default_generator: torch.Generator
) -> SamplingMetadata:
    temperature = states.temperature[rows]
    greedy = temperature < SAMPLING_EPS
    all_greedy = bool(greedy.all())
    all_random = not bool(greedy.any())
    row_list = rows.tolist()

    def used(column: torch.Tensor, neutral: float) -> torch.Tensor | None:
        values = column[rows]
        return values if bool((values != neutral).any()) else None

    top_k = top_p = min_p = None
    if not all_greedy:
        top_k = used(states.top_k, 0)
        top_p = used(states.top_p, 1.0)
        min_p = used(states.min_p, 0.0)
    repetition = used(states.repetition_penalty, 1.0)
    presence = used(states.presence_penalty, 0.0)
    frequency = used(states.frequency_penalty, 0.0)

    prompt_ids = output_ids = None
    if repetition is not None or presence is not None or frequency is not None:
        num_tokens = states.num_tokens[rows]
        num_prompt = states.num_prompt_tokens[rows]
        width = int(num_tokens.max())
        tokens = states.token_ids[rows, :width]
        pos = torch.arange(width).unsqueeze(0)
        pad = states.vocab_size
        prompt_ids = torch.where(pos < num_prompt[:, None], tokens, pad)
        is_output = (pos >= num_prompt[:, None]) & (pos < num_tokens[:, None])
        output_ids = torch.where(is_output, tokens, pad)

    generators: dict[int, torch.Generator] = {}
    min_tokens_mask: list[tuple[int, list[int]]] = []
    num_logprobs = [states.num_logprobs[r] for r in row_list]
    # Only seeded or min_tokens rows need per-row work; the common batch skips this loop.
    special = [
        (i, row)
        for i, row in enumerate(row_list)
        if states.seed[row] is not None or states.min_tokens_ids[row]
    ]
    for i, row in special:
        seed = states.seed[row]
        num_out = int(states.num_tokens[row] - states.num_prompt_tokens[row])
        if seed is not None and not bool(greedy[i]):
            gen = torch.Generator(device=default_generator.device)
            gen.manual_seed(step_seed(seed, num_out))
            generators[i] = gen
        if num_out < states.min_tokens[row] and states.min_tokens_ids[row]:
            min_tokens_mask.append((i, states.min_tokens_ids[row]))
    wanted = [n for n in num_logprobs if n is not None]

    device = default_generator.device
    return SamplingMetadata(
        temperature=temperature.to(device),
        all_greedy=all_greedy,
        all_random=all_random,
        top_k=None if top_k is None else top_k.to(device),
        top_p=None if top_p is None else top_p.to(device),
        min_p=None if min_p is None else min_p.to(device),
        repetition_penalty=None if repetition is None else repetition.to(device),
        presence_penalty=None if presence is None else presence.to(device),
        frequency_penalty=None if frequency is None else frequency.to(device),
        prompt_token_ids=None if prompt_ids is None else prompt_ids.to(device),
        output_token_ids=None if output_ids is None else output_ids.to(device),
        generators=generators,
        default_generator=default_generator,
        max_num_logprobs=max(wanted) if wanted else None,
        min_tokens_mask=min_tokens_mask,
    )


def logprobs_to_lists(
    lp: LogprobsTensors, num_logprobs: list[int | None]
) -> list[tuple[list[int], list[float], int] | None]:
    """Per row: (token ids, logprobs, rank of the first) trimmed to that row's top-N."""
    ids = lp.token_ids.tolist()
    values = lp.logprobs.tolist()
    ranks = lp.ranks.tolist()
    out: list[tuple[list[int], list[float], int] | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
        else:
            out.append((ids[i][: n + 1], values[i][: n + 1], ranks[i]))
    return out


def greedy_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> list[int] | None:
    """The sampler's tokens with `finite_rows` applied (-1 for a row whose maximum is not
    finite) where every row takes the plain argmax of its logits: greedy, nothing masked or
    penalised, no logprobs; None otherwise (then the sampler runs).

    Why: for such a step the sampler's work is one argmax per row (`argmax_rows`), but its
    dispatch (masks, penalties, a tensor of ids and its list) touches far more code and data
    than the argmax, and after a decode step has streamed the weights through the caches that
    costs ~50 us at batch 1 (the step takes ~7 ms).
    """
    if not (
        metadata.all_greedy
        and metadata.no_penalties
        and not metadata.min_tokens_mask
        and metadata.max_num_logprobs is None
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and not logits.requires_grad
    ):
        return None
    tokens = argmax_rows(logits).tolist()
    finite = finite_rows(logits, tokens, metadata)
    return [t if ok else -1 for t, ok in zip(tokens, finite, strict=True)]


def finite_rows(logits: torch.Tensor, tokens: list[int], metadata: SamplingMetadata) -> list[bool]:
    """Whether each row of `logits` has a finite maximum. NaN/inf weights give NaN logits,
    whose argmax is token 0 forever: such rows are flagged (a max propagates NaN and +inf,
    and is -inf only for a row with nothing finite).

    Where every row took the argmax of the raw logits (greedy, nothing masked or penalised),
    the sampled token's logit is the maximum (NaN counts as the maximum for argmax as well):
    reading it costs one element per row instead of another pass over the vocabulary.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        if metadata.all_greedy and metadata.no_penalties and not metadata.min_tokens_mask:
            return [math.isfinite(values[i, t]) for i, t in enumerate(tokens)]
        return np.isfinite(values.max(axis=-1)).tolist()
    return torch.isfinite(logits.amax(dim=-1)).tolist()
