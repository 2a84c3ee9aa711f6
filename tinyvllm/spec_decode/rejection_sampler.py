"""Verifies draft tokens against the target model's logits: lossless speculative sampling.

Each request i brings K_i draft tokens and K_i + 1 rows of target logits (one per draft plus
the bonus position). Every row is processed exactly as the plain `Sampler` would process it at
that point of decoding: min_tokens mask, penalties that count the drafts accepted before the
row as output tokens, then temperature, min_p, top_k and top_p.

Two verification rules, both lossless:

- One-hot drafts (`draft_probs=None`: n-gram, or a greedy draft model). Every row is sampled
  from the target distribution p with the plain sampler's noise, and draft j is accepted iff the
  sampled token equals it. That accepts with probability p(d), and after a rejection the token
  is p conditioned on "not d", which is exactly normalize(max(p - onehot(d), 0)). So the output
  is the plain sampler's token at every position: greedy requests get plain argmax decoding, and
  seeded requests (see `seeds`) get the very tokens non-speculative decoding would produce,
  whatever K or the batch.
- General drafts (`draft_probs` = q, the draft model's distribution the drafts were sampled
  from). Draft j is accepted iff u * q(d) < p(d) with u ~ U[0, 1) (probability min(1, p/q));
  the first rejected position samples from normalize(max(p - q, 0)) and an all-accepted run
  samples the bonus token from p. Greedy requests ignore q and accept iff d == argmax.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tinyvllm.sample.logprobs import LogprobsTensors, compute_token_logprobs
from tinyvllm.sample.metadata import SAMPLING_EPS, SamplingMetadata, step_seed
from tinyvllm.sample.penalties import apply_min_tokens_mask, apply_penalties
from tinyvllm.sample.sampler import (
    apply_min_p_,
    apply_temperature,
    apply_top_k_top_p_,
    argmax_rows,
    random_sample,
    sample,
)


@dataclass
class RejectionSamplerOutput:
    """What one verification step produced, per request (B = number of requests).

    - `token_ids`: per request the accepted drafts plus one token from the target (1..K_i + 1).
    - `num_accepted`: accepted drafts per request (`len(token_ids[i]) - 1`).
    - `padded_token_ids`: [B, max K + 1] int64 on the logits' device, -1 past each request's
      tokens.
    - `logprobs`: when the metadata asks for logprobs, one row per emitted token (request-major,
      in position order), from the raw target logits of the row that produced it.
    """

    token_ids: list[list[int]]
    num_accepted: list[int]
    padded_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def max_draft_tokens(
    k: int, num_output_tokens: int, min_tokens: int = 0, max_tokens: int | None = None
) -> int:
    """The most drafts a request may verify this step when the step's K is `k`.

    Below `min_tokens` the caller's metadata masks stop tokens on every row of the request, so
    all K + 1 positions must still be under min_tokens; that allows min_tokens - n - 1 drafts
    (0 for the last masked token). `max_tokens` caps the drafts so no token past it is computed.
    """
    if num_output_tokens < min_tokens:
        k = min(k, min_tokens - num_output_tokens - 1)
    if max_tokens is not None:
        k = min(k, max_tokens - num_output_tokens - 1)
    return max(k, 0)


@dataclass
class _Layout:
    """Where each request's positions sit in the flattened [sum(K_i + 1)] rows."""

    num_draft: list[int]
    starts: list[int]  # first row of request i
    draft_starts: list[int]  # first draft of request i in draft_token_ids
    counts: torch.Tensor  # [B] K_i
    starts_t: torch.Tensor  # [B]
    draft_starts_t: torch.Tensor  # [B]
    req_of_row: torch.Tensor  # [N] request of each row
    pos_of_row: torch.Tensor  # [N] position j of each row within its request
    draft_rows: torch.Tensor  # [sum K] row of each draft

    @property
    def max_k(self) -> int:
        return max(self.num_draft, default=0)

    @classmethod
    def build(cls, num_draft: list[int], device: torch.device) -> _Layout:
        starts, draft_starts = [], []
        row = draft = 0
        for k in num_draft:
            starts.append(row)
            draft_starts.append(draft)
            row += k + 1
            draft += k
        counts = torch.tensor(num_draft, dtype=torch.long, device=device)
        starts_t = torch.tensor(starts, dtype=torch.long, device=device)
        batch = torch.arange(len(num_draft), device=device)
        req_of_row = batch.repeat_interleave(counts + 1, output_size=row)
        # Each earlier request adds one bonus row between the drafts.
        req_of_draft = batch.repeat_interleave(counts, output_size=draft)
        return cls(
            num_draft=num_draft,
            starts=starts,
            draft_starts=draft_starts,
            counts=counts,
            starts_t=starts_t,
            draft_starts_t=torch.tensor(draft_starts, dtype=torch.long, device=device),
            req_of_row=req_of_row,
            pos_of_row=torch.arange(row, device=device) - starts_t[req_of_row],
            draft_rows=torch.arange(draft, device=device) + req_of_draft,
        )


class RejectionSampler(nn.Module):
    """Accepts the longest draft prefix the target agrees with, plus one target token."""

    def forward(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: list[int],
        metadata: SamplingMetadata,
        draft_probs: torch.Tensor | None = None,
        seeds: Mapping[int, tuple[int, int]] | None = None,
    ) -> RejectionSamplerOutput:
        """Verify one step's drafts.

        - `target_logits`: [sum(K_i + 1), V] raw target logits, request-major; never modified.
        - `draft_token_ids`: [sum K_i] int; `num_draft_tokens`: K_i per request (0 allowed).
        - `metadata`: one row per request, as `build_sampling_metadata` makes it for the
          pre-step state (`output_token_ids` without this step's drafts). Its
          `min_tokens_mask` is applied to every position of a masked request; cap K with
          `max_draft_tokens` so that is exact.
        - `draft_probs`: [sum K_i, V] draft distributions, or None for one-hot drafts.
        - `seeds`: request index -> (request seed, output tokens before this step). Position j
          of such a request draws its noise from a generator seeded with
          step_seed(seed, num_output + j), as plain decoding of that token would. A request
          with a `metadata.generators` entry but no `seeds` entry draws all its positions
          from that one generator in order (reproducible only for the same K).
        """
        device = target_logits.device
        if any(k < 0 for k in num_draft_tokens):
            raise ValueError(f"num_draft_tokens must be >= 0, got {list(num_draft_tokens)}")
        layout = _Layout.build(list(num_draft_tokens), device)
        _check_inputs(target_logits, draft_token_ids, layout, metadata, draft_probs)
        if not layout.num_draft:
            empty = torch.empty((0, 1), dtype=torch.long, device=device)
            return RejectionSamplerOutput([], [], empty, None)
        draft_ids = draft_token_ids.to(device=device, dtype=torch.long)
        draft_pad = _pad_drafts(draft_ids, layout)
        md, draft_generators = _expand_metadata(
            metadata, layout, draft_pad, seeds or {}, target_logits.shape[1]
        )

        logits = target_logits.float()
        processed = apply_min_tokens_mask(logits, md.min_tokens_mask)
        processed = apply_penalties(processed, md)
        if draft_probs is None:
            tokens = sample(processed, md)
            accept = tokens[layout.draft_rows] == draft_ids
        else:
            tokens, accept = _verify_with_probs(
                processed, md, draft_ids, draft_probs, layout, draft_generators
            )

        padded, num_accepted = _accepted_prefix(tokens, accept, draft_pad, layout)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            emitted = padded >= 0
            rows = (layout.starts_t.unsqueeze(1) + _positions(layout, device))[emitted]
            logprobs = compute_token_logprobs(
                target_logits[rows], padded[emitted], metadata.max_num_logprobs
            )
        num_list = num_accepted.tolist()
        token_lists = [r[: n + 1] for r, n in zip(padded.tolist(), num_list, strict=True)]
        return RejectionSamplerOutput(token_lists, num_list, padded, logprobs)


def _check_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    layout: _Layout,
    metadata: SamplingMetadata,
    draft_probs: torch.Tensor | None,
) -> None:
    num_draft = layout.num_draft
    num_reqs, total = len(num_draft), sum(num_draft)
    if metadata.temperature.shape[0] != num_reqs:
        raise ValueError(
            f"metadata has {metadata.temperature.shape[0]} rows but num_draft_tokens has "
            f"{num_reqs} requests; the metadata needs one row per request"
        )
    if target_logits.dim() != 2 or target_logits.shape[0] != total + num_reqs:
        raise ValueError(
            f"target_logits must be [sum(K_i + 1), V] = [{total + num_reqs}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    if draft_token_ids.numel() != total:
        raise ValueError(f"draft_token_ids has {draft_token_ids.numel()} ids, expected {total}")
    if draft_probs is not None and tuple(draft_probs.shape) != (total, target_logits.shape[1]):
        raise ValueError(
            f"draft_probs must be [{total}, {target_logits.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )


def _positions(layout: _Layout, device: torch.device) -> torch.Tensor:
    return torch.arange(layout.max_k + 1, device=device)


def _pad_drafts(draft_ids: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[B, max K] drafts per request, -1 past K_i."""
    num_reqs, max_k = len(layout.num_draft), layout.max_k
    if max_k == 0:
        return draft_ids.new_full((num_reqs, 0), -1)
    j = torch.arange(max_k, device=draft_ids.device)
    index = (layout.draft_starts_t.unsqueeze(1) + j).clamp(max=draft_ids.numel() - 1)
    return torch.where(j < layout.counts.unsqueeze(1), draft_ids[index], -1)


def _expand_metadata(
    metadata: SamplingMetadata,
    layout: _Layout,
    draft_pad: torch.Tensor,
    seeds: Mapping[int, tuple[int, int]],
    vocab_size: int,
) -> tuple[SamplingMetadata, list[tuple[int, torch.Generator]]]:
    """Per-request metadata -> per-row metadata, plus (draft index, generator) of seeded drafts.

    Row (i, j) counts drafts d_0..d_{j-1} as generated tokens: a row is only used when all of
    them were accepted, so its penalties then see exactly the tokens plain decoding would.
    """
    rows = layout.req_of_row

    def take(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[rows]

    output_ids = prompt_ids = None
    if not metadata.no_penalties:
        prompt_ids = take(metadata.prompt_token_ids)
        prior = metadata.output_token_ids
        if prior is None:
            prior = draft_pad.new_empty((draft_pad.shape[0], 0))
        prior = prior.to(draft_pad.device, torch.long)[rows]
        j = torch.arange(draft_pad.shape[1], device=draft_pad.device)
        drafts = draft_pad[rows]
        drafts = torch.where(j < layout.pos_of_row.unsqueeze(1), drafts, vocab_size)
        output_ids = torch.cat([prior, drafts], dim=1)
    min_tokens_mask = [
        (layout.starts[i] + j, ids)
        for i, ids in metadata.min_tokens_mask
        for j in range(layout.num_draft[i] + 1)
    ]
    generators, draft_generators = _position_generators(metadata, layout, seeds, rows.device)
    expanded = SamplingMetadata(
        temperature=metadata.temperature[rows],
        all_greedy=metadata.all_greedy,
        all_random=metadata.all_random,
        top_k=take(metadata.top_k),
        top_p=take(metadata.top_p),
        min_p=take(metadata.min_p),
        repetition_penalty=take(metadata.repetition_penalty),
        presence_penalty=take(metadata.presence_penalty),
        frequency_penalty=take(metadata.frequency_penalty),
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        generators=generators,
        default_generator=metadata.default_generator,
        min_tokens_mask=min_tokens_mask,
    )
    return expanded, draft_generators


def _position_generators(
    metadata: SamplingMetadata,
    layout: _Layout,
    seeds: Mapping[int, tuple[int, int]],
    device: torch.device,
) -> tuple[dict[int, torch.Generator], list[tuple[int, torch.Generator]]]:
    requests = sorted(set(seeds) | set(metadata.generators))
    generators: dict[int, torch.Generator] = {}
    draft_generators: list[tuple[int, torch.Generator]] = []
    if not requests:
        return generators, draft_generators
    greedy = (metadata.temperature < SAMPLING_EPS).tolist()
    for i in requests:
        if greedy[i]:
            continue  # argmax rows never read noise
        for j in range(layout.num_draft[i] + 1):
            if i in seeds:
                seed, num_output = seeds[i]
                gen = torch.Generator(device=device)
                gen.manual_seed(step_seed(seed, num_output + j))
            else:
                gen = metadata.generators[i]
            generators[layout.starts[i] + j] = gen
            if j < layout.num_draft[i]:
                draft_generators.append((layout.draft_starts[i] + j, gen))
    return generators, draft_generators


def _target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Penalised logits -> the distribution `sample` draws from (same steps, same order)."""
    logits = apply_temperature(logits, md.temperature, md.all_random)
    if md.min_p is not None:
        apply_min_p_(logits, md.min_p)
    top_k = md.top_k
    if top_k is not None and not md.all_random:
        top_k = torch.where(md.temperature < SAMPLING_EPS, 1, top_k)
    if top_k is not None or md.top_p is not None:
        apply_top_k_top_p_(logits, top_k, md.top_p)
    return logits.softmax(dim=-1)


def _verify_with_probs(
    processed: torch.Tensor,
    md: SamplingMetadata,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    layout: _Layout,
    draft_generators: list[tuple[int, torch.Generator]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token per row if that row is reached, acceptance per draft) for general drafts."""
    greedy_tokens = None if md.all_random else argmax_rows(processed)
    if greedy_tokens is not None and md.all_greedy:
        return greedy_tokens, greedy_tokens[layout.draft_rows] == draft_ids

    probs = _target_probs(processed, md)
    rows = layout.draft_rows
    p = probs[rows]
    q = draft_probs.to(probs.device, probs.dtype)
    ids = draft_ids.unsqueeze(1)
    p_draft, q_draft = p.gather(1, ids).squeeze(1), q.gather(1, ids).squeeze(1)
    residual = (p - q).clamp_(min=0.0)
    # p == q (up to rounding) leaves no residual mass; such drafts are accepted with
    # probability ~1, and p is the right distribution for the rare rounding-induced reject.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
    probs.index_copy_(0, rows, residual)
    # The exponential race needs no normalisation, so residual rows are used as they are.
    tokens = random_sample(probs, md.generators, md.default_generator)

    uniforms = torch.rand(rows.shape[0], generator=md.default_generator, device=probs.device)
    for index, gen in draft_generators:
        uniforms[index] = torch.rand(1, generator=gen, device=probs.device)[0]
    # u < p / q without dividing by a zero q.
    accept = uniforms * q_draft < p_draft
    if greedy_tokens is not None:
        greedy_rows = md.temperature < SAMPLING_EPS
        tokens = torch.where(greedy_rows, greedy_tokens, tokens)
        accept = torch.where(greedy_rows[rows], greedy_tokens[rows] == draft_ids, accept)
    return tokens, accept


def _accepted_prefix(
    tokens: torch.Tensor, accept: torch.Tensor, draft_pad: torch.Tensor, layout: _Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, max K + 1] emitted tokens padded with -1, [B] accepted drafts per request)."""
    device = tokens.device
    num_reqs, max_k = len(layout.num_draft), layout.max_k
    j = _positions(layout, device)
    if max_k > 0:
        index = (layout.draft_starts_t.unsqueeze(1) + j[:max_k]).clamp(max=accept.numel() - 1)
        accepted = accept[index] & (j[:max_k] < layout.counts.unsqueeze(1))
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(num_reqs, dtype=torch.long, device=device)
    rows = (layout.starts_t.unsqueeze(1) + j).clamp(max=tokens.numel() - 1)
    target = tokens[rows]
    drafts = torch.cat([draft_pad, draft_pad.new_full((num_reqs, 1), -1)], dim=1)
    n = num_accepted.unsqueeze(1)
    padded = torch.where(j < n, drafts, torch.where(j == n, target, -1))
    return padded, num_accepted
