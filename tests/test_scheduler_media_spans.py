"""Scheduling with bidirectional media spans (`atomic_mm_spans`, Gemma 3 images): chunks never
split a span, a span larger than the budget is refused at
add time, and a prefix-cache hit ending inside a span is rounded down to the span's block."""

from __future__ import annotations

import pytest
from test_scheduler import EOS, check_invariants, fake_run, make_scheduler

from tinyvllm.request import MultiModalFeature, Request
from tinyvllm.sampling_params import SamplingParams


def image_request(rid: str, spans: list[tuple[int, int]], length: int, image: str) -> Request:
    prompt = list(range(3, 3 + length))
    features = [
        MultiModalFeature("image", f"{image}{k}", off, n) for k, (off, n) in enumerate(spans)
    ]
    for off, n in spans:
        prompt[off : off + n] = [99] * n
    return Request(rid, prompt, SamplingParams(max_tokens=2), EOS, 2, mm_features=features)


def chunks(scheduler, rid: str) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """(start, end) of each step's scheduled tokens for `rid` until its prompt is done."""
    out = []
    request = scheduler.requests[rid]
    while True:
        start = request.num_computed_tokens
        step = scheduler.schedule()
        n = step.num_scheduled_tokens.get(rid, 0)
        if n:
            out.append((start, start + n))
        scheduler.update_from_output(step, fake_run(step, scheduler))
        check_invariants(scheduler)
        if request.num_computed_tokens >= len(request.prompt_token_ids):
            break
    return out


def test_chunks_keep_spans_whole() -> None:
    s = make_scheduler(64, max_num_batched_tokens=8, atomic_mm_spans=True)
    s.add_request(image_request("a", [(3, 4), (8, 2), (14, 5)], 22, "img"))
    # [8, 10) and the text after it share a chunk; [14, 19) would be cut at 16: stop before.
    assert chunks(s, "a") == [(0, 8), (8, 14), (14, 22)]
    s = make_scheduler(64, max_num_batched_tokens=12, atomic_mm_spans=True)
    s.add_request(image_request("b", [(1, 3), (5, 4), (10, 5)], 20, "img"))
    assert chunks(s, "b") == [(0, 10), (10, 20)]  # two whole spans in the first chunk


def test_without_atomic_spans_chunks_split_them() -> None:
    s = make_scheduler(64, max_num_batched_tokens=8)
    s.add_request(image_request("a", [(3, 4), (8, 2), (14, 5)], 22, "img"))
    assert chunks(s, "a") == [(0, 8), (8, 16), (16, 22)]


def test_span_larger_than_budget_is_refused() -> None:
    s = make_scheduler(64, max_num_batched_tokens=4, atomic_mm_spans=True)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4"):
        s.add_request(image_request("a", [(2, 5)], 10, "img"))


def test_prefix_hit_never_ends_inside_a_span() -> None:
    s = make_scheduler(64, enable_caching=True, atomic_mm_spans=True)
    # Span [5, 11) ends the prompt: the second request's full-block hit (block size 4, the
    # last token left to compute) would end at 8, inside it.
    s.add_request(image_request("a", [(5, 6)], 11, "img"))
    chunks(s, "a")
    s.add_request(image_request("b", [(5, 6)], 11, "img"))
    step = s.schedule()
    assert s.requests["b"].num_cached_tokens == 4  # rounded down to the span's block
    assert step.num_scheduled_tokens["b"] == 7
    # Another image shares only the text before it.
    s.add_request(image_request("c", [(5, 6)], 11, "other"))
    s.update_from_output(step, fake_run(step, s))
    step = s.schedule()
    assert s.requests["c"].num_cached_tokens == 4
