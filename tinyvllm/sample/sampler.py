"""logits -> next tokens for a whole batch, vectorised over rows.

Order (vLLM v1): min_tokens mask -> penalties -> greedy argmax -> temperature -> min_p ->
top_k -> top_p -> exponential-race sampling. Logprobs come from the raw logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tinyvllm.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from tinyvllm.sample.metadata import SAMPLING_EPS, SamplingMetadata
from tinyvllm.sample.penalties import apply_min_tokens_mask, apply_penalties


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # [B, 1 + max_num_logprobs] when any row asked


class Sampler(nn.Module):
    """Samples one token per row of `logits` [B, V]; never modifies `logits` in place."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dtype != torch.float32:  # (a no-op .float() still costs a dispatch)
            logits = logits.float()
        processed = apply_min_tokens_mask(logits, metadata.min_tokens_mask)
        processed = apply_penalties(processed, metadata)
        sampled = sample(processed, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            # Computed after sampling so the raw logprobs and the sampling workspace are never
            # alive at once; `logits` itself was left untouched.
            logprobs = gather_logprobs(compute_logprobs(logits), sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Greedy rows take the argmax of `logits`; the rest sample. Returns [B] int64."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    greedy: torch.Tensor | None = None
    if not metadata.all_random:
        greedy = argmax_rows(logits)
        if metadata.all_greedy:
            return greedy

    logits = apply_temperature(logits, metadata.temperature, metadata.all_random)
    # `logits` is now a fresh tensor owned here, so the filters below work in place.
    if metadata.min_p is not None:
        apply_min_p_(logits, metadata.min_p)
    top_k = metadata.top_k
    if top_k is not None and greedy is not None:
        # Greedy rows' filtered logits are discarded anyway; ranking them as k = 1 keeps a
        # greedy row without top_k from forcing a full sort of the vocabulary.
        top_k = torch.where(metadata.temperature < SAMPLING_EPS, 1, top_k)
    if top_k is not None or metadata.top_p is not None:
        apply_top_k_top_p_(logits, top_k, metadata.top_p)
    sampled = random_sample(logits.softmax(dim=-1), metadata.generators, metadata.default_generator)

    if greedy is None:
        return sampled
    return torch.where(metadata.temperature < SAMPLING_EPS, greedy, sampled)


def apply_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, all_random: bool
) -> torch.Tensor:
    if not all_random:
        # Greedy rows were already decided; keep their values finite so nothing NaNs.
        temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits / temperature.unsqueeze(1).to(logits.dtype)


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below `min_p` times the row's top probability.

    Done in log space (logit < max_logit + log(min_p)), which needs no softmax; min_p = 0
    gives a threshold of -inf and so disables the row.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.to(logits.dtype).log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, -math.inf)


def _top_k_rows(top_k: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(enabled [B] bool, k [B] int64 with disabled rows set to 1 so gathers stay in range)."""
    top_k = top_k.to(torch.long)
    enabled = (top_k > 0) & (top_k < vocab_size)
    return enabled, torch.where(enabled, top_k, 1)


def _top_p_threshold(sorted_desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, 1] smallest logit that top_p keeps, given each row's logits sorted descending.

    A token survives while the mass strictly before it is below top_p of the row's total, so
    the top token always survives. Unnormalised weights and a cumsum (no softmax) keep the
    numbers independent of how many -inf entries trail a row, so a top-k slice and a full
    sort agree.
    """
    weights = (sorted_desc - sorted_desc[:, :1]).exp()
    cumulative = weights.cumsum(dim=1)
    # top_p = 1 keeps everything even if float rounding flattens the cumsum early.
    top_p = torch.where(top_p < 1.0, top_p.to(weights.dtype), float("inf"))
    limit = top_p.unsqueeze(1) * cumulative[:, -1:]
    num_kept = 1 + (cumulative[:, :-1] < limit).sum(dim=1, keepdim=True)
    return sorted_desc.gather(1, num_kept - 1)


def apply_top_k_top_p_(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> None:
    """Keep each row's top_k tokens, then the top_p share of the renormalised survivors.

    Both filters end as a per-row logit threshold, so equal logits are always kept or dropped
    together and no sort's tie order leaks into the result. The vocabulary is only fully
    sorted when top_p is used by a batch in which some row has no (small) top_k.
    """
    vocab_size = logits.shape[1]
    enabled: torch.Tensor | None = None
    k: torch.Tensor | None = None
    width = vocab_size
    if top_k is not None:
        enabled, k = _top_k_rows(top_k, vocab_size)
        # One device sync. Without top_p a row lacking top_k needs nothing ranked (it counts
        # as k = 1); with top_p it needs every token ranked.
        width = int((k if top_p is None else torch.where(enabled, k, vocab_size)).max())
    if top_p is None or 4 * width <= vocab_size:
        ranked = torch.topk(logits, width, dim=1).values
    else:
        ranked = torch.sort(logits, dim=1, descending=True).values

    threshold = torch.full_like(ranked[:, :1], -math.inf)
    if k is not None and enabled is not None:
        # The k-th largest logit; tokens tied with it are kept too.
        threshold = ranked.gather(1, (k - 1).unsqueeze(1))
        threshold.masked_fill_(~enabled.unsqueeze(1), -math.inf)
    if top_p is not None:
        if k is not None and enabled is not None:
            # top_p's mass counts exactly the first k ranked values (never ties past them),
            # which are the same numbers whether `ranked` is a top-k slice or a full sort.
            positions = torch.arange(ranked.shape[1], device=ranked.device)
            ranked.masked_fill_(enabled.unsqueeze(1) & (positions >= k.unsqueeze(1)), -math.inf)
        threshold = torch.maximum(threshold, _top_p_threshold(ranked, top_p))
    logits.masked_fill_(logits < threshold, -math.inf)


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Categorical sample per row via argmax(probs / q), q ~ Exp(1) (the exponential race).

    Unlike torch.multinomial this lets each seeded row draw its noise from its own generator
    (one row of V draws per step, so a seed reproduces regardless of batch order or size),
    while all other rows share a single vectorised draw from `default_generator` (the engine's
    seeded generator; the global RNG when None).
    Consumes `probs`.
    """
    q = torch.empty_like(probs)
    # u in [tiny, 1): a raw draw of 0 becomes the smallest normal float (the bounds leave all
    # other draws unchanged), so q = -log(u) is finite and positive. A zero q would make a
    # masked token's 0 / 0 a NaN that argmax picks; an infinite one could zero out a row's
    # only allowed token.
    low = torch.finfo(q.dtype).tiny
    if len(generators) < probs.shape[0]:
        q.uniform_(low, 1.0, generator=default_generator)
    for row, generator in generators.items():
        q[row].uniform_(low, 1.0, generator=generator)
    # -log(u) is Exp(1); on CPU this is several times faster than exponential_.
    q.log_().neg_()
    return argmax_rows(probs.div_(q))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a [B, V] tensor: [B] int64, the first maximal index of each row,
    NaN counting as the maximum (as torch and numpy both define it, so the two agree).

    Why numpy on CPU: torch's CPU argmax does not vectorise, 70 us for one 49k-entry row of
    logits and 1.1 ms for 16 rows, against 3 us and 0.13 ms for numpy's; at 5 ms a decode
    step that is a large share of what is not the model.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1]:
        values = (x.detach() if x.requires_grad else x).numpy()
        return torch.from_numpy(values.argmax(axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)
