"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and allocation
with lookahead."""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.core.block_pool import ROOT_HASH, BlockHash, BlockPool, BlockPoolStats, hash_block
from tinyvllm.request import Request


@dataclass
class PrefixCacheCounters:
    """Prompt tokens looked up in the prefix cache, and how many of them hit."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


@dataclass(frozen=True)
class BlockInfo:
    """One block as a UI draws it: 'free', 'cached' (free but reusable) or 'used'."""

    block_id: int
    state: str
    ref_count: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheStats:
    """The manager's own snapshot (`KVCacheManager.stats()`): block counts and lifetime
    prefix-cache counters, plus the per-block view when asked for."""

    pool: BlockPoolStats
    block_size: int
    prefix_caching: bool
    prefix_queries: int  # prompt tokens looked up
    prefix_hits: int  # of those, tokens found cached
    blocks: tuple[BlockInfo, ...] = ()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.counters = PrefixCacheCounters()
        self._blocks: dict[str, list[int]] = {}
        # Per request: how many of its leading blocks are registered in the cache already.
        self._num_cached: dict[str, int] = {}

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Hashes of the request's full blocks within its first `num_tokens` tokens.

        Hashes are memoised on the request: its tokens only ever grow, so a computed hash
        stays valid (also across preemption).
        """
        hashes = request.block_hashes
        num_full = num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), num_full):
                start = i * self.block_size
                end = start + self.block_size
                parent = hash_block(parent, tokens[start:end], _media_keys(request, start, end))
                hashes.append(parent)
        return hashes[:num_full]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a new request: (block ids, number of tokens).

        At least the last token is always left to compute, so a fully cached prompt still
        produces logits. Requests asking for prompt logprobs skip the cache: cached positions
        would have no logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hits: list[int] = []
        for block_hash in self.block_hashes(request, request.num_tokens - 1):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def next_uncached_hash(self, request: Request, num_hit_blocks: int) -> BlockHash | None:
        """The hash of the first block after a request's cache hits (None: no full block)."""
        hashes = self.block_hashes(request, request.num_tokens - 1)
        return hashes[num_hit_blocks] if num_hit_blocks < len(hashes) else None

    def record_lookup(self, request: Request, num_cached_tokens: int) -> None:
        """Count an admitted request's prompt tokens and cache hits (a lookup retried after a
        deferred admission counts once)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return
        self.counters.requests += 1
        self.counters.queries += request.num_tokens
        self.counters.hits += num_cached_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's blocks whose KV is now fully written.

        Called after a model step, so a block becomes visible to other requests only once its
        KV exists (two requests sharing a prefix in one step both compute it).
        """
        if not self.enable_caching:
            return
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached[request.request_id] = num_full

    def reset_prefix_cache(self) -> int:
        self._num_cached = {rid: len(b) for rid, b in self._blocks.items()}
        return self.pool.reset_prefix_cache()

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        computed_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` (+ lookahead for draft tokens) beyond the computed ones.

        `computed_blocks` are prefix-cache hits for a new request (already counted in its
        `num_computed_tokens`); they are taken over before new blocks are drawn, so the
        allocation can never evict them. Returns the newly drawn block ids, or None when the
        pool cannot cover them (the caller then preempts or waits); nothing changes then.
        """
        computed_blocks = computed_blocks or []
        blocks = self._blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = self.num_blocks_needed(total) - len(blocks) - len(computed_blocks)
        # Hits on cached-free blocks leave the free queue, so they count against it too.
        reclaimed = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if max(needed, 0) + reclaimed > self.pool.num_free_blocks:
            return None
        blocks = self._blocks.setdefault(request.request_id, blocks)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self._num_cached[request.request_id] = len(blocks)
        if needed <= 0:
            return []
        new_blocks = self.pool.allocate(needed)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        self._num_cached.pop(request.request_id, None)
        blocks = self._blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])

    # ---- views ------------------------------------------------------------------------------
    def stats(self, include_blocks: bool = False) -> KVCacheStats:
        counters = self.counters
        return KVCacheStats(
            pool=self.pool.stats(),
            block_size=self.block_size,
            prefix_caching=self.enable_caching,
            prefix_queries=counters.queries,
            prefix_hits=counters.hits,
            blocks=tuple(self.block_view()) if include_blocks else (),
        )

    def num_requests(self) -> int:
        return len(self._blocks)

    def block_view(self) -> list[BlockInfo]:
        """Every block's state and owners, for a UI's KV-cache map."""
        owners: dict[int, list[str]] = {}
        for rid, blocks in self._blocks.items():
            for b in blocks:
                owners.setdefault(b, []).append(rid)
        pool = self.pool
        view = []
        for b in range(pool.num_blocks):
            if pool.ref_counts[b] > 0:
                state = "used"
            elif pool.block_hashes[b] is not None:
                state = "cached"
            else:
                state = "free"
            view.append(BlockInfo(b, state, pool.ref_counts[b], tuple(owners.get(b, ()))))
        return view


def _media_keys(request: Request, start: int, end: int) -> tuple[object, ...]:
    """The content hashes of the images / videos whose placeholders overlap tokens
    [start, end): placeholder tokens are the same for every picture of one size, so without
    these two different videos would share their KV blocks. The offset into the item tells
    apart the blocks of one item (and an item placed at another position)."""
    return tuple(
        (f.identifier, start - f.offset)
        for f in request.mm_features
        if f.offset < end and start < f.end
    )
