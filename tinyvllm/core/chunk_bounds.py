"""Where a scheduled chunk of a request's tokens may end (the scheduler's chunked prefill):
never inside a media span whose tokens must run in one chunk (`atomic_mm_spans`), and for
hybrid models caching recurrent state, on a block boundary where the state can be
snapshotted."""

from __future__ import annotations

from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.request import Request


def shape_chunk(kv: KVCacheManager, request: Request, num_new: int, atomic_mm_spans: bool) -> int:
    """The `num_new` tokens the budget allows `request` cut to a chunk that may run this
    step (0 or less: none does)."""
    return fit_spans(request, align_chunk(kv, request, num_new), atomic_mm_spans)


def fit_spans(request: Request, num_new: int, atomic_mm_spans: bool) -> int:
    """`num_new` cut so that the chunk splits no media span (`atomic_mm_spans`): it ends
    before the first span it would cut; 0 when that span starts the chunk."""
    if not atomic_mm_spans:
        return num_new
    start = request.num_computed_tokens
    end = start + num_new
    cut = [f.offset for f in request.mm_features if f.offset < end < f.end]
    return max(0, min(cut) - start) if cut else num_new


def round_hit(
    request: Request, hits: list[int], block_size: int, atomic_mm_spans: bool
) -> list[int]:
    """A prefix-cache hit ending inside a media span, rounded down to the block where the
    span starts (`atomic_mm_spans`: the span's tokens run in one chunk); sets the request's
    computed count to match."""
    if not atomic_mm_spans:
        return hits
    n = request.num_computed_tokens
    for f in request.mm_features:
        if f.offset < n < f.end:
            n = f.offset // block_size * block_size
    request.num_computed_tokens = n
    return hits[: n // block_size]


def align_chunk(kv: KVCacheManager, request: Request, num_new: int) -> int:
    """Hybrid models caching state: end a prefill chunk on a block boundary, where its
    state can be snapshotted. A chunk stops where the KV cache's copy of its prefix ends
    (another request's prompt diverged there: a shared prefix, worth a snapshot); a chunk
    cut by the budget ends at the last boundary it reaches; a prompt's final chunk stops
    at the last boundary before its last token (the next step computes the rest). A
    boundary whose prefix has a snapshot already is no reason to stop."""
    if not kv.aligns_chunks or request.num_computed_tokens >= request.num_prompt_tokens:
        return num_new
    start = request.num_computed_tokens
    block_size = kv.block_size
    shared_end = kv.cached_prefix_end(request, start - start % block_size)
    if start < shared_end < start + num_new and not kv.has_snapshot(request, shared_end):
        return shared_end - start
    if start + num_new < request.num_tokens:
        aligned = (start + num_new) // block_size * block_size
    else:
        aligned = (request.num_tokens - 1) // block_size * block_size
        if aligned > request.num_prompt_tokens or kv.has_snapshot(request, aligned):
            return num_new
    return aligned - start if aligned > start else num_new
