"""Sampler tests: greedy exactness, seeded reproducibility, distributions, penalties, logprobs.

The statistical tests compare sample frequencies with a float64 numpy reference that applies
temperature -> min_p -> top_k -> top_p by its own (per-token counting) algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tinyvllm.sample import (
    SAMPLING_EPS,
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    compute_token_logprobs,
)
from tinyvllm.sample.penalties import apply_penalties
from tinyvllm.sample.sampler import apply_top_k_top_p_


def make_metadata(temperature: list[float], **kwargs: object) -> SamplingMetadata:
    temp = torch.tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temp,
        all_greedy=bool((temp < SAMPLING_EPS).all()),
        all_random=bool((temp >= SAMPLING_EPS).all()),
        **kwargs,  # type: ignore[arg-type]
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    # torch.testing.assert_close lazily imports torch.distributed (seconds on a small CPU).
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    expected = expected.to(actual.dtype)
    assert torch.allclose(actual, expected, rtol=tol, atol=tol), (actual, expected)


def pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)


# ---------------------------------------------------------------- greedy


def test_all_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = Sampler()(logits, make_metadata([0.0] * 8))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    temps = [0.0, 1.0, 0.0, 0.7, 1e-6, 1.5]
    greedy_rows = [0, 2, 4]
    sampler = Sampler()
    for _ in range(20):
        logits = torch.randn(6, 64, generator=gen)
        before = logits.clone()
        md = make_metadata(
            temps,
            top_k=torch.tensor([1, 5, 3, 0, 2, 10]),
            top_p=torch.tensor([0.1, 0.9, 1.0, 0.5, 0.2, 1.0]),
            min_p=torch.tensor([0.5, 0.0, 0.3, 0.1, 0.0, 0.0]),
        )
        out = sampler(logits, md).sampled_token_ids
        assert torch.equal(out[greedy_rows], logits.argmax(dim=-1)[greedy_rows])
        assert torch.equal(logits, before)


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    md = make_metadata(
        [0.0],
        repetition_penalty=torch.tensor([2.0]),
        prompt_token_ids=torch.tensor([[0, 4]]),  # 4 = vocab_size = padding
        output_token_ids=torch.zeros((1, 0), dtype=torch.long),
    )
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]


# ---------------------------------------------------------------- seeds


def _sample_request_in_batch(
    seed: int, row: int, others: list[dict[str, float]], steps: int, target: dict[str, float]
) -> list[int]:
    """Sample `steps` tokens for one seeded request placed at `row` among `others`."""
    vocab = 64
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(7)) * 0.3
    rows = list(others)
    rows.insert(row, target)
    temps = [r["temperature"] for r in rows]
    generators = {row: torch.Generator().manual_seed(seed)}
    # Other seeded rows must not disturb the target's stream.
    generators.update(
        {i: torch.Generator().manual_seed(1000 + i) for i, r in enumerate(rows) if r.get("seeded")}
    )
    md = make_metadata(
        temps,
        top_k=torch.tensor([int(r.get("top_k", 0)) for r in rows]),
        top_p=torch.tensor([r.get("top_p", 1.0) for r in rows]),
        min_p=torch.tensor([r.get("min_p", 0.0) for r in rows]),
        generators=generators,
    )
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(rows), vocab)  # other rows: arbitrary, from the global RNG
        logits[row] = step_logits[step]
        tokens.append(int(sampler(logits, md).sampled_token_ids[row]))
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        {"temperature": 0.9},
        # With top_k on every row the batch takes the top-k slice path, otherwise a full sort.
        {"temperature": 0.9, "top_k": 12, "top_p": 0.8, "min_p": 0.01},
    ],
    ids=["plain", "top_k_top_p"],
)
def test_seeded_rows_reproduce_regardless_of_batch_and_position(
    target: dict[str, float],
) -> None:
    alone = _sample_request_in_batch(seed=1234, row=0, others=[], steps=30, target=target)
    crowded = _sample_request_in_batch(
        seed=1234,
        row=3,
        others=[
            {"temperature": 0.0},
            {"temperature": 1.0, "top_k": 5, "seeded": 1},
            {"temperature": 0.5, "top_p": 0.7, "min_p": 0.2},
            {"temperature": 1.2},
        ],
        steps=30,
        target=target,
    )
    torch.manual_seed(999)  # a different global RNG state must not matter either
    other_place = _sample_request_in_batch(
        seed=1234, row=1, others=[{"temperature": 1.0, "top_k": 3}], steps=30, target=target
    )
    assert alone == crowded == other_place
    assert len(set(alone)) > 3
    assert _sample_request_in_batch(seed=4321, row=0, others=[], steps=30, target=target) != alone


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(64, 50)
    md = make_metadata([1.0] * 64)
    first = Sampler()(logits, md).sampled_token_ids
    second = Sampler()(logits, md).sampled_token_ids
    assert not torch.equal(first, second)
    assert len(set(first.tolist())) > 10  # rows get independent noise


def test_extreme_noise_never_picks_a_masked_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even if every uniform draw hits its lower bound, only allowed tokens can win."""

    def lowest(self: torch.Tensor, low: float = 0.0, high: float = 1.0, **_: object) -> object:
        return self.fill_(low)

    monkeypatch.setattr(torch.Tensor, "uniform_", lowest)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(8))
    md = make_metadata(
        [1.0, 1.0, 0.5, 1.0], top_k=torch.tensor([1, 3, 1, 0]), generators={2: torch.Generator()}
    )
    out = Sampler()(logits, md).sampled_token_ids
    assert out[:3].tolist() == logits[:3].argmax(dim=-1).tolist()


# ---------------------------------------------------------------- distributions


@dataclass
class Config:
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def reference_probs(logits: np.ndarray, cfg: Config) -> np.ndarray:
    """float64 reference: temperature -> min_p -> top_k (ties kept) -> top_p."""
    x = logits.astype(np.float64) / cfg.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= cfg.min_p * p.max()
    vocab = len(x)
    if 0 < cfg.top_k < vocab:
        # Kept iff fewer than k min_p survivors are strictly larger (so ties are kept).
        survivors = keep.copy()
        keep = np.array(
            [survivors[i] and np.sum(survivors & (x > x[i])) < cfg.top_k for i in range(vocab)]
        )
    if cfg.top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        new_keep = np.zeros_like(keep)
        for i in range(vocab):
            mass_before = q[q > q[i]].sum()
            new_keep[i] = keep[i] and mass_before < cfg.top_p
        keep = new_keep
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def chi2_threshold(dof: int, z: float = 5.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof); z = 5 is a ~3e-7 false-alarm rate."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def assert_matches(samples: np.ndarray, expected: np.ndarray) -> None:
    n = len(samples)
    counts = np.bincount(samples, minlength=len(expected)).astype(np.float64)
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, f"sampled forbidden tokens {np.nonzero(counts * ~allowed)}"
    freq = counts / n
    # Per token: 6 binomial standard deviations plus a 1/n lattice slack.
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 6 * sigma + 1.0 / n), (freq, expected)
    dof = int(allowed.sum()) - 1
    if dof > 0:
        e = expected[allowed] * n
        stat = float((((counts[allowed] - e) ** 2) / e).sum())
        assert stat < chi2_threshold(dof), (stat, dof, freq, expected)


VOCAB = 12
BASE_LOGITS = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5).numpy()
CONFIGS = [
    Config(temperature=1.0),
    Config(temperature=0.7),
    Config(temperature=1.3, top_k=4),
    Config(temperature=1.0, top_p=0.6),
    Config(temperature=0.8, top_k=5, top_p=0.8),
    Config(temperature=1.0, min_p=0.1),
    Config(temperature=0.9, min_p=0.05, top_k=6, top_p=0.9),
    Config(temperature=2.0, top_k=1),
    Config(temperature=1.0, min_p=0.3, top_k=8),  # min_p leaves fewer than k
    Config(temperature=1.0, top_k=3, top_p=0.7),  # small k: top-p on a top-k slice, no sort
]
N_SAMPLES = 20_000


def _metadata_for(configs: list[Config], seeded: bool = False) -> SamplingMetadata:
    """Like the runner: a feature's tensor is None when no row uses it."""
    top_k, top_p, min_p = (
        [c.top_k for c in configs],
        [c.top_p for c in configs],
        [c.min_p for c in configs],
    )
    return make_metadata(
        [c.temperature for c in configs],
        top_k=torch.tensor(top_k) if any(top_k) else None,
        top_p=torch.tensor(top_p) if min(top_p) < 1.0 else None,
        min_p=torch.tensor(min_p) if any(min_p) else None,
        generators=(
            {i: torch.Generator().manual_seed(i) for i in range(len(configs))} if seeded else {}
        ),
    )


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_distribution_matches_reference(cfg: Config) -> None:
    torch.manual_seed(0)
    logits = torch.from_numpy(BASE_LOGITS).float().expand(N_SAMPLES, VOCAB).contiguous()
    out = Sampler()(logits, _metadata_for([cfg] * N_SAMPLES)).sampled_token_ids
    assert_matches(out.numpy(), reference_probs(BASE_LOGITS, cfg))


def test_heterogeneous_batch_matches_reference_per_row() -> None:
    """All configs plus greedy rows interleaved in one batch: each row follows its own params."""
    torch.manual_seed(1)
    configs = [*CONFIGS, Config(temperature=0.0)]
    batch = configs * N_SAMPLES
    logits = torch.from_numpy(BASE_LOGITS).float().expand(len(batch), VOCAB).contiguous()
    out = Sampler()(logits, _metadata_for(batch)).sampled_token_ids.numpy()
    for i, cfg in enumerate(CONFIGS):
        assert_matches(out[i :: len(configs)], reference_probs(BASE_LOGITS, cfg))
    assert np.all(out[len(CONFIGS) :: len(configs)] == BASE_LOGITS.argmax())


def test_seeded_rows_follow_the_distribution() -> None:
    cfg = Config(temperature=0.8, top_k=6, top_p=0.9)
    logits = torch.from_numpy(BASE_LOGITS).float().expand(N_SAMPLES, VOCAB).contiguous()
    md = _metadata_for([cfg] * N_SAMPLES, seeded=True)
    out = Sampler()(logits, md).sampled_token_ids
    assert_matches(out.numpy(), reference_probs(BASE_LOGITS, cfg))


def test_top_k_top_p_without_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without top_p nothing sorts the vocab; top_k asks topk for the largest enabled k only."""
    real_topk = torch.topk
    ks: list[int] = []

    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("full sort used")

    def spy_topk(x: torch.Tensor, k: int, *args: object, **kwargs: object) -> object:
        ks.append(k)
        return real_topk(x, k, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch, "topk", spy_topk)
    logits = torch.randn(4, 1000)
    Sampler()(logits, make_metadata([1.0, 0.5, 0.0, 1.0], min_p=torch.tensor([0.1, 0, 0, 0])))
    assert ks == []
    md = make_metadata([1.0, 0.5, 0.0, 1.0], top_k=torch.tensor([0, 7, 3, 1000]))
    Sampler()(logits, md)
    assert ks == [7]
    # top_p with a small top_k on every row ranks only the widest top-k slice.
    md = make_metadata([1.0, 0.5, 0.0, 1.0], top_k=torch.tensor([5, 7, 3, 20]), top_p=torch.rand(4))
    Sampler()(logits, md)
    assert ks == [7, 20]
    # A greedy row without top_k does not force a sort either.
    md = make_metadata([1.0, 0.5, 0.0, 1.0], top_k=torch.tensor([5, 7, 0, 20]), top_p=torch.rand(4))
    Sampler()(logits, md)
    assert ks == [7, 20, 20]


def reference_keep(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference mask: ties with the k-th value are kept, top_p by strict-mass rule."""
    x = logits.astype(np.float64)
    keep = np.ones(len(x), dtype=bool)
    if 0 < top_k < len(x):
        keep = (x[None, :] > x[:, None]).sum(axis=1) < top_k
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        keep &= (p[None, :] * (p[None, :] > p[:, None])).sum(axis=1) < top_p
    return keep


def test_top_k_top_p_slice_and_full_sort_agree_with_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 100, 500
    logits = torch.randn(rows, vocab, generator=gen) * 2
    top_k = torch.randint(1, 60, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.95 + 0.05
    top_p[::7] = 1.0
    for r in range(20):
        # Exact ties with the k-th value: all of them survive top_k.
        order = logits[r].argsort(descending=True)
        k = int(top_k[r])
        logits[r, order[k : k + 3]] = float(logits[r, order[k - 1]])
        top_p[r] = 1.0
    # Ties straddling the top-p boundary survive or go together.
    logits[20] = -30.0
    logits[20, :5] = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]).log()
    top_k[20], top_p[20] = 5, 0.5

    sliced = logits.clone()
    apply_top_k_top_p_(sliced, top_k, top_p)
    # One extra row without top_k forces the full-sort path for the whole batch.
    full = torch.cat([logits, torch.randn(1, vocab)])
    apply_top_k_top_p_(
        full,
        torch.cat([top_k, torch.zeros(1, dtype=torch.long)]),
        torch.cat([top_p, torch.ones(1)]),
    )
    assert torch.equal(sliced, full[:rows])
    kept = ~torch.isinf(sliced)
    for r in range(rows):
        expected = reference_keep(logits[r].numpy(), int(top_k[r]), float(top_p[r]))
        assert np.array_equal(kept[r].numpy(), expected), r
    assert torch.equal(sliced[kept], logits[kept])  # survivors keep their values
    assert all(int(kept[r].sum()) == int(top_k[r]) + 3 for r in range(20))
    assert kept[20].nonzero().flatten().tolist() == [0, 1, 2]  # both 0.2s, though 0.4+0.2>0.5


# ---------------------------------------------------------------- penalties


def reference_penalties(
    logits: torch.Tensor,
    prompts: list[list[int]],
    outputs: list[list[int]],
    rep: list[float],
    pres: list[float],
    freq: list[float],
) -> torch.Tensor:
    out = logits.clone()
    for b in range(out.shape[0]):
        for tok in set(prompts[b]) | set(outputs[b]):
            v = out[b, tok]
            out[b, tok] = v / rep[b] if v > 0 else v * rep[b]
        for tok in set(outputs[b]):
            out[b, tok] -= freq[b] * outputs[b].count(tok) + pres[b]
    return out


def test_penalties_match_reference() -> None:
    vocab = 20
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 3
    prompts = [[1, 2, 3, 3], [4], [5, 6, 7, 8, 9], []]
    outputs = [[3, 10, 10, 10], [], [5, 11], [0, 0, 19]]
    rep, pres, freq = [1.3, 1.0, 0.7, 2.0], [0.5, 0.2, 0.0, -0.4], [0.25, 0.0, 1.0, 0.1]
    md = make_metadata(
        [1.0] * 4,
        repetition_penalty=torch.tensor(rep),
        presence_penalty=torch.tensor(pres),
        frequency_penalty=torch.tensor(freq),
        prompt_token_ids=pad(prompts, vocab),
        output_token_ids=pad(outputs, vocab),
    )
    got = apply_penalties(logits, md)
    assert_close(got, reference_penalties(logits, prompts, outputs, rep, pres, freq))
    # Prompt-only tokens get no presence/frequency penalty.
    assert got[1, 4] == logits[1, 4]


def test_repetition_penalty_matches_hf_processor() -> None:
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    vocab = 30
    ids = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(2))
    logits = torch.randn(3, vocab) * 4
    hf = logits_process.RepetitionPenaltyLogitsProcessor(1.8)(ids, logits.clone())
    md = make_metadata(
        [1.0] * 3,
        repetition_penalty=torch.full((3,), 1.8),
        prompt_token_ids=ids[:, :5],
        output_token_ids=ids[:, 5:],
    )
    assert torch.equal(apply_penalties(logits, md), hf)


def test_presence_only_without_prompt_ids() -> None:
    logits = torch.zeros(2, 5)
    md = make_metadata(
        [1.0, 1.0],
        presence_penalty=torch.tensor([1.0, 0.0]),
        output_token_ids=pad([[2, 2], []], 5),
    )
    assert apply_penalties(logits, md).tolist() == [[0, 0, -1, 0, 0], [0, 0, 0, 0, 0]]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_forbids_eos_and_stop_ids() -> None:
    eos, stop = 5, 7
    base = torch.zeros(16)
    base[eos], base[stop], base[2] = 10.0, 9.0, 8.0
    logits = base.expand(2, 16).contiguous()
    md = make_metadata([0.0, 0.0], min_tokens_mask=[(0, [eos, stop])])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, eos]
    assert logits[0, eos] == 10.0  # caller's logits untouched

    torch.manual_seed(0)
    rows = 4000
    logits = (base * 0.2).expand(rows, 16).contiguous()
    mask = [(r, [eos, stop]) for r in range(0, rows, 2)]
    out = Sampler()(logits, make_metadata([1.5] * rows, min_tokens_mask=mask)).sampled_token_ids
    assert not set(out[0::2].tolist()) & {eos, stop}
    assert {eos, stop} <= set(out[1::2].tolist())


# ---------------------------------------------------------------- logprobs


def numpy_ranks(logprobs: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    return np.array(
        [1 + int((row > row[t]).sum()) for row, t in zip(logprobs, token_ids, strict=True)]
    )


def test_logprobs_from_raw_logits_with_sampled_token_first() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(9)) * 2
    md = make_metadata(
        [0.0, 1.0, 0.5, 0.0, 2.0, 1.0],
        top_k=torch.tensor([0, 5, 0, 0, 3, 0]),
        repetition_penalty=torch.tensor([1.5, 1.2, 1.0, 2.0, 1.0, 1.0]),
        prompt_token_ids=pad([[1, 2], [3], [], [int(logits[3].argmax())], [], [7]], 50),
        output_token_ids=pad([[4], [], [], [], [], []], 50),
        max_num_logprobs=5,
    )
    out = Sampler()(logits, md)
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    assert lp.token_ids.shape == lp.logprobs.shape == (6, 6)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)

    raw = torch.log_softmax(logits.double(), dim=-1)
    assert_close(lp.logprobs.double(), raw.gather(1, lp.token_ids))
    expected_top = raw.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], expected_top.indices)
    assert torch.all(lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:])
    assert lp.ranks.tolist() == numpy_ranks(raw.numpy(), out.sampled_token_ids.numpy()).tolist()
    # Row 3 is greedy but its argmax was penalised away, so its raw rank is not 1.
    assert lp.ranks[3] > 1


def test_logprobs_zero_and_none() -> None:
    logits = torch.randn(3, 10)
    out = Sampler()(logits, make_metadata([1.0, 0.0, 1.0], max_num_logprobs=0))
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (3, 1)
    assert torch.equal(out.logprobs.token_ids[:, 0], out.sampled_token_ids)
    assert Sampler()(logits, make_metadata([1.0, 0.0, 1.0])).logprobs is None


def test_ranks_with_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]]).expand(5, 5)
    out = compute_token_logprobs(logits, torch.arange(5), num_logprobs=3)
    # Tied tokens share a rank; the next distinct value ranks after all of them.
    assert out.ranks.tolist() == [4, 1, 1, 3, 5]
    assert sorted(out.token_ids[0, 1:3].tolist()) == [1, 2]
    assert out.token_ids[0, 3] == 3
    greedy = Sampler()(logits[:1], make_metadata([0.0], max_num_logprobs=1))
    assert greedy.sampled_token_ids.tolist() == [1]  # first index among tied maxima
    assert greedy.logprobs is not None and greedy.logprobs.ranks.tolist() == [1]


def test_compute_token_logprobs_for_prompt() -> None:
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(4)).bfloat16()
    next_tokens = torch.tensor([3, 0, 39, 12, 12, 5, 1])
    out = compute_token_logprobs(logits, next_tokens, num_logprobs=4)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.token_ids.shape == (7, 5) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.token_ids[:, 0], next_tokens)
    assert_close(out.logprobs[:, 0], raw[torch.arange(7), next_tokens])
    assert_close(out.logprobs[:, 1:], raw.topk(4, dim=-1).values)
    assert out.ranks.tolist() == numpy_ranks(raw.numpy(), next_tokens.numpy()).tolist()
    # Asking for more alternatives than the vocabulary has is clamped, not an error.
    assert compute_token_logprobs(logits[:, :3], torch.zeros(7), 10).token_ids.shape == (7, 4)
    assert out.slice_rows(2, 4).ranks.tolist() == out.ranks[2:4].tolist()
