"""Rejection sampler: exactness against plain decoding, losslessness, seeds, bookkeeping.

The oracle for one-hot drafts is plain step-by-step decoding with `Sampler`: each position is
sampled with the penalties of the tokens before it and the noise of its output index, and the
run stops at the first token that differs from the draft. The oracle for general drafts is the
target distribution itself, checked statistically on large batches of identical requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tinyvllm.sample import SAMPLING_EPS, Sampler, SamplingMetadata, compute_token_logprobs
from tinyvllm.sample.metadata import step_seed
from tinyvllm.sample.sampler import apply_min_p_, apply_temperature, apply_top_k_top_p_
from tinyvllm.spec_decode import RejectionSampler, max_draft_tokens

VOCAB = 32


@dataclass
class Req:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    seed: int | None = None
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])
    output: list[int] = field(default_factory=list)
    min_tokens_ids: list[int] = field(default_factory=list)  # masked at every position


def pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)


def metadata_for(reqs: list[Req], generators: dict[int, torch.Generator] | None = None):
    """Like the runner: per request, a feature's tensor is None when no request uses it."""
    temp = torch.tensor([r.temperature for r in reqs])

    def used(values: list[float], neutral: float) -> torch.Tensor | None:
        return torch.tensor(values) if any(v != neutral for v in values) else None

    rep = used([r.repetition for r in reqs], 1.0)
    pres = used([r.presence for r in reqs], 0.0)
    freq = used([r.frequency for r in reqs], 0.0)
    penalised = rep is not None or pres is not None or freq is not None
    return SamplingMetadata(
        temperature=temp,
        all_greedy=bool((temp < SAMPLING_EPS).all()),
        all_random=bool((temp >= SAMPLING_EPS).all()),
        top_k=used([r.top_k for r in reqs], 0),
        top_p=used([r.top_p for r in reqs], 1.0),
        min_p=used([r.min_p for r in reqs], 0.0),
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        prompt_token_ids=pad([r.prompt for r in reqs], VOCAB) if penalised else None,
        output_token_ids=pad([r.output for r in reqs], VOCAB) if penalised else None,
        generators=generators or {},
        min_tokens_mask=[(i, r.min_tokens_ids) for i, r in enumerate(reqs) if r.min_tokens_ids],
    )


def seeds_for(reqs: list[Req]) -> dict[int, tuple[int, int]]:
    return {i: (r.seed, len(r.output)) for i, r in enumerate(reqs) if r.seed is not None}


def plain_decoding(req: Req, logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Decode position by position with `Sampler`; stop at the first disagreement."""
    out = list(req.output)
    emitted: list[int] = []
    for j in range(len(drafts) + 1):
        step = Req(**{**req.__dict__, "output": out})
        gens = {}
        if req.seed is not None:
            gens = {0: torch.Generator().manual_seed(step_seed(req.seed, len(out)))}
        token = int(Sampler()(logits[j : j + 1], metadata_for([step], gens)).sampled_token_ids)
        emitted.append(token)
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return emitted


def run_batch(reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor, **kwargs: object):
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    return RejectionSampler()(
        logits, flat, [len(d) for d in drafts], metadata_for(reqs), seeds=seeds_for(reqs), **kwargs
    )


def request_logits(num_draft: list[int], seed: int, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(num_draft) + len(num_draft), VOCAB, generator=gen) * scale


def drafts_against(reqs: list[Req], logits: torch.Tensor, plan: list[tuple[int, int]]):
    """Per request (K, first wrong position or K): drafts equal to plain decoding up to there."""
    drafts, start = [], 0
    for req, (k, wrong_at) in zip(reqs, plan, strict=True):
        rows = logits[start : start + k + 1]
        start += k + 1
        good: list[int] = []
        # Build the draft one token at a time from what plain decoding emits after it.
        for _ in range(k):
            good.append(plain_decoding(req, rows, [*good, -1])[len(good)])
        if wrong_at < k:
            good[wrong_at] = (good[wrong_at] + 1) % VOCAB
        drafts.append(good)
    return drafts


# ---------------------------------------------------------------- exactness vs plain decoding


PLAN = [(3, 3), (0, 0), (4, 0), (2, 1), (5, 3), (0, 0), (1, 1), (3, 2)]


def test_greedy_is_plain_argmax_with_mixed_k() -> None:
    reqs = [Req() for _ in PLAN]
    logits = request_logits([k for k, _ in PLAN], seed=0)
    drafts = drafts_against(reqs, logits, PLAN)
    before = logits.clone()
    out = run_batch(reqs, drafts, logits)
    assert torch.equal(logits, before)
    assert out.num_accepted == [min(k, w) for k, w in PLAN]
    start = 0
    for i, (k, _) in enumerate(PLAN):
        rows = logits[start : start + k + 1]
        start += k + 1
        argmax = rows.argmax(dim=-1).tolist()
        n = out.num_accepted[i]
        assert out.token_ids[i] == argmax[: n + 1]
        assert out.token_ids[i] == plain_decoding(reqs[i], rows, drafts[i])
    width = max(k for k, _ in PLAN) + 1
    assert out.padded_token_ids.shape == (len(PLAN), width)
    for i, tokens in enumerate(out.token_ids):
        row = out.padded_token_ids[i].tolist()
        assert row == tokens + [-1] * (width - len(tokens))


def test_random_greedy_drafts_many_batches() -> None:
    gen = torch.Generator().manual_seed(5)
    for trial in range(20):
        ks = torch.randint(0, 5, (6,), generator=gen).tolist()
        logits = request_logits(ks, seed=100 + trial, scale=1.0)
        # Drafts agree with the argmax with probability 0.7 per position.
        argmax = logits.argmax(dim=-1)
        drafts, start = [], 0
        for k in ks:
            guess = argmax[start : start + k].clone()
            flip = torch.rand(k, generator=gen) < 0.3
            guess[flip] = (guess[flip] + 1) % VOCAB
            drafts.append(guess.tolist())
            start += k + 1
        out = run_batch([Req() for _ in ks], drafts, logits)
        start = 0
        for i, k in enumerate(ks):
            expected = plain_decoding(Req(), logits[start : start + k + 1], drafts[i])
            assert out.token_ids[i] == expected
            start += k + 1


MIXED = [
    Req(repetition=1.8, presence=0.5, output=[5, 6]),
    Req(temperature=0.8, top_k=6, top_p=0.9, seed=11, frequency=0.7, output=[4, 4]),
    Req(temperature=1.2, min_p=0.05, seed=12, repetition=1.3),
    Req(min_tokens_ids=[0, 1, 2]),
    Req(temperature=0.6, top_p=0.8, seed=13, min_tokens_ids=[7]),
    Req(temperature=1.0, seed=14),
]


@pytest.mark.parametrize("wrong", [False, True], ids=["drafts_right", "drafts_wrong"])
def test_one_hot_drafts_reproduce_plain_decoding(wrong: bool) -> None:
    """Penalties see earlier drafts, min_tokens masks, seeds use their output index: every
    request emits exactly what plain decoding emits, whatever it is batched with."""
    plan = [(3, 1 if wrong else 3), (4, 2 if wrong else 4), (2, 0 if wrong else 2), (3, 3)]
    plan += [(0, 0), (5, 4 if wrong else 5)]
    logits = request_logits([k for k, _ in plan], seed=21, scale=1.5)
    # Penalised and min_tokens-masked ids must matter: make them strong.
    logits[:, [4, 5, 6]] += 2.0
    starts = np.cumsum([0] + [k + 1 for k, _ in plan]).tolist()
    logits[starts[3] : starts[4], 0] += 6.0
    logits[starts[4] : starts[5], 7] += 6.0
    drafts = drafts_against(MIXED, logits, plan)
    out = run_batch(MIXED, drafts, logits)
    start = 0
    for i, (k, wrong_at) in enumerate(plan):
        expected = plain_decoding(MIXED[i], logits[start : start + k + 1], drafts[i])
        assert out.token_ids[i] == expected, i
        assert out.num_accepted[i] == min(k, wrong_at)
        start += k + 1
    assert not {0, 1, 2} & set(out.token_ids[3])
    # Alone, in another order, each seeded request gives the same tokens.
    for i in (1, 2, 4, 5):
        k = plan[i][0]
        rows = logits[sum(kk + 1 for kk, _ in plan[:i]) :][: k + 1]
        alone = run_batch([Req(), MIXED[i]], [[], drafts[i]], torch.cat([logits[:1], rows]))
        assert alone.token_ids[1] == out.token_ids[i]


def test_seeded_request_independent_of_k() -> None:
    """With drafts that plain decoding agrees with, K only changes how many tokens one step
    yields, never which tokens."""
    req = Req(temperature=0.9, top_k=10, seed=77)
    logits = request_logits([6], seed=3, scale=0.5)
    full = drafts_against([req], logits, [(6, 6)])[0]
    long = run_batch([req], [full], logits).token_ids[0]
    assert len(long) == 7
    for k in range(6):
        short = run_batch([req], [full[:k]], logits[: k + 1]).token_ids[0]
        assert short == long[: k + 1]


def test_unseeded_sampling_uses_default_generator() -> None:
    logits = torch.zeros(2 * 64, VOCAB)
    md = metadata_for([Req(temperature=1.0) for _ in range(64)])
    flat = torch.tensor([3] * 64)

    def run(seed: int) -> list[list[int]]:
        md.default_generator = torch.Generator().manual_seed(seed)
        return RejectionSampler()(logits, flat, [1] * 64, md).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


# ---------------------------------------------------------------- losslessness

N = 20_000
V = 5


def processed_probs(logits: torch.Tensor, req: Req) -> np.ndarray:
    """The plain sampler's distribution for one row, from the sampler's own functions."""
    x = apply_temperature(logits[None].float(), torch.tensor([req.temperature]), True)
    if req.min_p:
        apply_min_p_(x, torch.tensor([req.min_p]))
    if req.top_k or req.top_p < 1.0:
        apply_top_k_top_p_(
            x,
            torch.tensor([req.top_k]) if req.top_k else None,
            torch.tensor([req.top_p]) if req.top_p < 1.0 else None,
        )
    return x.softmax(dim=-1)[0].double().numpy()


def assert_distribution(samples: np.ndarray, expected: np.ndarray) -> None:
    n = len(samples)
    counts = np.bincount(samples, minlength=len(expected)).astype(np.float64)
    assert counts[expected == 0].sum() == 0, (counts, expected)
    freq = counts / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 6 * sigma + 1.0 / n), (freq, expected)
    allowed = expected > 0
    dof = int(allowed.sum()) - 1
    if dof > 0:
        e = expected[allowed] * n
        stat = float((((counts[allowed] - e) ** 2) / e).sum())
        c = 2.0 / (9.0 * dof)  # Wilson-Hilferty chi-square quantile, z = 5
        assert stat < dof * (1.0 - c + 5.0 * math.sqrt(c)) ** 3, (stat, freq, expected)


POSITION_LOGITS = torch.tensor(
    [
        [1.0, 0.2, -0.5, 0.8, 0.0],
        [-0.3, 0.9, 0.4, 0.1, -1.0],
        [0.5, 0.5, -0.2, 1.2, 0.3],
    ]
)
Q = torch.tensor([[0.1, 0.5, 0.1, 0.2, 0.1], [0.3, 0.05, 0.4, 0.05, 0.2]])
CONFIGS = [
    Req(temperature=1.0),
    Req(temperature=0.7, top_k=3),
    Req(temperature=1.3, top_p=0.75),
    Req(temperature=0.9, top_k=4, top_p=0.9, min_p=0.2),
]


@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot_q", "general_q"])
@pytest.mark.parametrize("req", CONFIGS, ids=lambda r: f"t{r.temperature}k{r.top_k}p{r.top_p}")
def test_emitted_tokens_follow_target_distribution(req: Req, one_hot: bool) -> None:
    """K = 2 per request: token 0 ~ p0, token 1 | (draft 0 accepted) ~ p1, and the bonus
    token | (both accepted) ~ p2."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if one_hot:
        drafts = torch.tensor([1, 3]).repeat(N)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(Q[j], N, True, generator=gen) for j in (0, 1)], 1)
        drafts = drafts.flatten()
        draft_probs = Q.repeat(N, 1)
    logits = POSITION_LOGITS.repeat(N, 1)
    md = metadata_for([req] * N)
    out = RejectionSampler()(logits, drafts, [2] * N, md, draft_probs=draft_probs)
    padded = out.padded_token_ids.numpy()
    accepted = np.array(out.num_accepted)
    expected = [processed_probs(POSITION_LOGITS[j], req) for j in range(3)]
    assert_distribution(padded[:, 0], expected[0])
    assert_distribution(padded[accepted >= 1, 1], expected[1])
    if (accepted == 2).sum() > 500:
        assert_distribution(padded[accepted == 2, 2], expected[2])
    # Acceptance rate of the first draft: sum_d q(d) min(1, p(d)/q(d)) = sum_d min(p, q).
    q0 = np.eye(V)[1] if one_hot else Q[0].double().numpy()
    rate = np.minimum(expected[0], q0).sum()
    assert abs((accepted >= 1).mean() - rate) < 6 * math.sqrt(rate * (1 - rate) / N) + 1e-3


def test_bonus_token_sampled_when_all_accepted() -> None:
    torch.manual_seed(2)
    logits = torch.full((3, V), -30.0)
    logits[0, 2] = logits[1, 4] = 10.0  # the drafts are certain
    logits[2] = POSITION_LOGITS[2]
    req = Req(temperature=1.0)
    for draft_probs in (None, Q.repeat(N, 1)):
        out = RejectionSampler()(
            logits.repeat(N, 1),
            torch.tensor([2, 4]).repeat(N),
            [2] * N,
            metadata_for([req] * N),
            draft_probs=draft_probs,
        )
        assert set(out.num_accepted) == {2}
        assert_distribution(out.padded_token_ids[:, 2].numpy(), processed_probs(logits[2], req))


def test_general_q_seeded_reproducible_and_greedy_ignores_q() -> None:
    reqs = [Req(temperature=0.8, seed=5), Req(), Req(temperature=1.1, top_k=3, seed=6)]
    ks = [3, 2, 2]
    logits = request_logits(ks, seed=8, scale=1.0)
    gen = torch.Generator().manual_seed(9)
    q = torch.rand(sum(ks), VOCAB, generator=gen).softmax(dim=-1)
    drafts = [torch.multinomial(q[i], 1, generator=gen).tolist() for i in range(sum(ks))]
    drafts = [d[0] for d in drafts]
    nested = [drafts[:3], drafts[3:5], drafts[5:]]
    first = run_batch(reqs, nested, logits, draft_probs=q)
    second = run_batch(reqs, nested, logits, draft_probs=q)
    assert first.token_ids == second.token_ids
    # The greedy request behaves as with one-hot drafts.
    assert first.token_ids[1] == plain_decoding(Req(), logits[4:7], nested[1])
    # A seeded request alone gives the same tokens.
    alone = run_batch(reqs[2:], nested[2:], logits[7:], draft_probs=q[5:])
    assert alone.token_ids[0] == first.token_ids[2]


# ---------------------------------------------------------------- logprobs, errors, helpers


def test_logprobs_cover_emitted_tokens_from_raw_logits() -> None:
    ks = [2, 0, 3]
    logits = request_logits(ks, seed=4)
    reqs = [Req(repetition=2.0, output=[7]), Req(), Req()]
    drafts = drafts_against(reqs, logits, [(2, 2), (0, 0), (3, 1)])
    md = metadata_for(reqs)
    md.max_num_logprobs = 3
    flat = torch.tensor([t for d in drafts for t in d])
    out = RejectionSampler()(logits, flat, ks, md)
    assert out.logprobs is not None
    rows = [0, 1, 2, 3, 4, 5]  # request 0: all 3 rows; request 1: row 3; request 2: rows 4, 5
    tokens = [t for ids in out.token_ids for t in ids]
    assert len(tokens) == len(rows)
    expected = compute_token_logprobs(logits[rows], torch.tensor(tokens), 3)
    assert torch.equal(out.logprobs.token_ids, expected.token_ids)
    assert torch.allclose(out.logprobs.logprobs, expected.logprobs)


def test_input_errors_are_clear() -> None:
    md = metadata_for([Req(), Req()])
    sampler = RejectionSampler()
    with pytest.raises(ValueError, match=r"\[sum\(K_i \+ 1\), V\] = \[4, V\]"):
        sampler(torch.zeros(3, VOCAB), torch.zeros(2, dtype=torch.long), [1, 1], md)
    with pytest.raises(ValueError, match="one row per request"):
        sampler(torch.zeros(3, VOCAB), torch.zeros(0, dtype=torch.long), [0, 0, 0], md)
    with pytest.raises(ValueError, match="draft_token_ids has 1 ids, expected 2"):
        sampler(torch.zeros(4, VOCAB), torch.zeros(1, dtype=torch.long), [1, 1], md)
    with pytest.raises(ValueError, match=">= 0"):
        sampler(torch.zeros(2, VOCAB), torch.zeros(0, dtype=torch.long), [1, -1], md)
    with pytest.raises(ValueError, match="draft_probs must be"):
        sampler(
            torch.zeros(4, VOCAB),
            torch.zeros(2, dtype=torch.long),
            [1, 1],
            md,
            draft_probs=torch.zeros(2, 3),
        )


def test_empty_batch() -> None:
    out = RejectionSampler()(
        torch.zeros(0, VOCAB), torch.zeros(0, dtype=torch.long), [], metadata_for([])
    )
    assert out.token_ids == [] and out.num_accepted == []


def test_max_draft_tokens() -> None:
    assert max_draft_tokens(4, num_output_tokens=10) == 4
    # Below min_tokens every verified position must still be masked.
    assert max_draft_tokens(4, num_output_tokens=2, min_tokens=5) == 2
    assert max_draft_tokens(4, num_output_tokens=4, min_tokens=5) == 0
    assert max_draft_tokens(4, num_output_tokens=5, min_tokens=5) == 4
    assert max_draft_tokens(4, num_output_tokens=7, max_tokens=9) == 1
    assert max_draft_tokens(4, num_output_tokens=8, max_tokens=9) == 0
