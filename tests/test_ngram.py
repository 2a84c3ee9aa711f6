"""N-gram proposer: hand-made sequences, a brute-force reference, batch equivalence."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.spec_decode import NgramProposer


def reference(seq: list[int], low: int, high: int, k: int, earliest: bool = False) -> list[int]:
    """Longest n first; for that n the latest (or earliest) earlier occurrence with a token
    after it."""
    for n in range(min(high, len(seq) - 1), low - 1, -1):
        suffix = seq[len(seq) - n :]
        starts = range(len(seq) - n - 1, -1, -1)
        for start in reversed(starts) if earliest else starts:
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def propose(seqs: list[list[int]], low: int, high: int, k: int | list[int] = 4) -> list[list[int]]:
    proposer = NgramProposer(low, high, num_speculative_tokens=4)
    return proposer.propose([torch.tensor(s) for s in seqs], k)


@pytest.mark.parametrize(
    ("seq", "low", "high", "expected"),
    [
        ([5, 6, 7, 8, 9, 5, 6], 1, 3, [7, 8, 9, 5]),  # match at the start
        ([0, 1, 5, 6, 7, 8, 9, 5, 6], 2, 2, [7, 8, 9, 5]),  # match in the middle
        # A 3-gram match wins over a more recent 1-gram match ...
        ([1, 2, 3, 9, 9, 3, 4, 1, 2, 3], 1, 3, [9, 9, 3, 4]),
        # ... unless n is capped at 1.
        ([1, 2, 3, 9, 9, 3, 4, 1, 2, 3], 1, 1, [4, 1, 2, 3]),
        ([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, [8, 1, 2]),  # most recent; cut at the sequence end
        ([7, 7, 7, 7], 1, 3, [7]),  # overlapping occurrence, one token follows it
        ([1, 2, 3, 4], 1, 3, []),  # nothing repeats
        ([1, 2, 9, 1, 2], 3, 4, []),  # only a 2-gram repeats, min is 3
        ([3], 1, 2, []),  # too short for any earlier occurrence
        ([3, 3], 1, 2, [3]),
        ([], 1, 2, []),
    ],
)
def test_hand_made_sequences(seq: list[int], low: int, high: int, expected: list[int]) -> None:
    assert reference(seq, low, high, 4) == expected
    assert propose([seq], low, high) == [expected]


def test_prefer_earliest_like_vllm() -> None:
    seq = [1, 2, 7, 1, 2, 8, 1, 2]
    proposer = NgramProposer(1, 2, 4, prefer_earliest=True)
    assert proposer.propose([torch.tensor(seq)]) == [[7, 1, 2, 8]]
    assert proposer.propose([torch.tensor([7, 7, 7, 7])]) == [[7, 7]]


def test_k_per_request_and_clamping() -> None:
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose([seq, seq, seq], 1, 2, [0, 2, 9]) == [[], [3, 4], [3, 4, 5, 6]]
    assert propose([seq], 1, 2, 1) == [[3]]


def test_padded_tensor_with_lengths_ignores_padding() -> None:
    seqs = [[1, 2, 3, 1, 2], [4, 4], [9, 8, 7, 9, 8, 7, 9]]
    width = 10
    # Padding that would match if read: the proposer must stop at each row's length.
    padded = torch.full((3, width), 2)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = torch.tensor(s)
    proposer = NgramProposer(1, 3, 3)
    from_padded = proposer.propose(padded, lengths=[len(s) for s in seqs])
    assert from_padded == proposer.propose([torch.tensor(s) for s in seqs])
    assert from_padded == [[3, 1, 2], [4], [8, 7, 9]]
    drafts, num = proposer.propose_tensors(padded, lengths=torch.tensor([5, 2, 7]))
    assert num.tolist() == [3, 1, 3]
    assert drafts.tolist() == [[3, 1, 2], [4, -1, -1], [8, 7, 9]]


@pytest.mark.parametrize("earliest", [False, True], ids=["latest", "earliest"])
@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_batch_matches_reference_and_single_requests(low: int, high: int, earliest: bool) -> None:
    gen = torch.Generator().manual_seed(low * 10 + high)
    seqs = []
    for _ in range(40):
        length = int(torch.randint(0, 40, (1,), generator=gen))
        vocab = int(torch.randint(2, 6, (1,), generator=gen))
        seqs.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    ks = torch.randint(0, 6, (len(seqs),), generator=gen).tolist()
    proposer = NgramProposer(low, high, num_speculative_tokens=5, prefer_earliest=earliest)
    batched = proposer.propose([torch.tensor(s, dtype=torch.long) for s in seqs], ks)
    for seq, k, got in zip(seqs, ks, batched, strict=True):
        assert got == reference(seq, low, high, k, earliest), (seq, k)
        assert proposer.propose([torch.tensor(seq, dtype=torch.long)], [k]) == [got]
    assert sum(1 for g in batched if g) >= 8  # the test exercises matches, not just misses


def test_int32_buffer_and_empty_batch() -> None:
    proposer = NgramProposer(1, 2, 2)
    buffer = torch.tensor([[1, 2, 1, 0, 0]], dtype=torch.int32)
    assert proposer.propose(buffer, lengths=[3]) == [[2, 1]]
    assert proposer.propose([]) == []
    assert proposer.propose(torch.zeros((0, 4), dtype=torch.long)) == []


def test_errors() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min must be at least 1"):
        NgramProposer(0, 2, 3)
    with pytest.raises(ValueError, match="prompt_lookup_max=1 must be at least"):
        NgramProposer(2, 1, 3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(1, 2, 0)
    proposer = NgramProposer(1, 2, 3)
    with pytest.raises(ValueError, match="lengths must have 2 entries"):
        proposer.propose(torch.zeros((2, 4), dtype=torch.long), lengths=[1])
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\]"):
        proposer.propose(torch.zeros((2, 4), dtype=torch.long), lengths=[1, 5])
    with pytest.raises(ValueError, match="k_per_request must have 1 entries"):
        proposer.propose([torch.tensor([1, 1])], [1, 2])
