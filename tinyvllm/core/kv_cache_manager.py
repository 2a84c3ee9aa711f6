"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and allocation
with lookahead; for hybrid models also the recurrent-state slots (`core/state_pool.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.core.block_pool import ROOT_HASH, BlockHash, BlockPool, BlockPoolStats, hash_block
from tinyvllm.core.state_pool import StatePool, StatePoolStats
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
    # Hybrid models: a recurrent-state snapshot is cached for the prefix ending at this block.
    state_snapshot: bool = False


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
    # Hybrid models' recurrent-state slots (None: the model has none).
    state: StatePoolStats | None = None


class KVCacheManager:
    """`num_running_states` > 0 marks a hybrid model: every running request also holds a
    recurrent-state slot, and with caching the prefix cache is limited to block boundaries
    that have a state snapshot (`num_snapshot_states` slots; "align" mode)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_running_states: int = 0,
        num_snapshot_states: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.states: StatePool | None = None
        if num_running_states:
            self.states = StatePool(num_running_states, num_snapshot_states, enable_caching)
            self.pool.on_evict = self.states.forget
        # Hybrid requests admitted this step -> the snapshot slot their state starts from.
        self._restores: dict[str, int | None] = {}
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
        # Streaming input: a block is final only once the input of all its tokens arrived.
        num_full = max(0, min(num_tokens, request.num_input_tokens)) // self.block_size
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

        At least the last token (of a streaming-input request: the last one whose input has
        arrived) is always left to compute, so a fully cached prompt still produces logits.
        Requests asking for prompt logprobs skip the cache: cached positions would have no
        logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hits: list[int] = []
        hashes = self.block_hashes(request, request.num_schedulable_tokens - 1)
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.states is not None:
            # The recurrent layers resume only from a snapshot: a hit ends at the last hit
            # block that has one (none before the first full block).
            # The KV past the last snapshot is recomputed, but stays cached (kept recent):
            # that prefix is shared, and the chunk that recomputes it ends there with a
            # snapshot (chunk_bounds.align_chunk), so later requests hit all of it.
            kv_hits = list(hits)
            while hits and not self.states.has_snapshot(hashes[len(hits) - 1]):
                hits.pop()
            self.pool.refresh(kv_hits[len(hits) :])
        return hits, len(hits) * self.block_size

    @property
    def aligns_chunks(self) -> bool:
        """Whether prefill chunks should end on block boundaries (hybrid models caching state
        snapshots: a snapshot can only be taken where a chunk ends)."""
        return self.states is not None and self.states.caching

    def waits_for_inflight(
        self, request: Request, num_hit_blocks: int, inflight: set[BlockHash]
    ) -> bool:
        """Whether a waiting request should wait a step to read a prefix this step computes.

        Attention-only models wait when their next uncached block is being computed. Hybrid
        models can resume only from a snapshot, so they wait only when a snapshot this step
        takes lies on their own chain (`inflight` then holds only snapshot hashes)."""
        if not inflight:
            return False
        if self.states is None:
            return self.next_uncached_hash(request, num_hit_blocks) in inflight
        hashes = self.block_hashes(request, request.num_schedulable_tokens - 1)
        return any(h in inflight for h in hashes[num_hit_blocks:])

    def next_uncached_hash(self, request: Request, num_hit_blocks: int) -> BlockHash | None:
        """The hash of the first block after a request's cache hits (None: no full block)."""
        hashes = self.block_hashes(request, request.num_schedulable_tokens - 1)
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
        if self.states is not None:
            self.states.commit(request.request_id)
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
        if self.states is not None:
            self.states.reset_prefix_cache()
        return self.pool.reset_prefix_cache()

    # ---- recurrent state (hybrid models) ----------------------------------------------------
    def state_slots(self, request: Request) -> tuple[int | None, int | None]:
        """A newly admitted request's (running state slot, snapshot slot to restore from);
        (None, None) for models without recurrent state."""
        if self.states is None:
            return None, None
        return (
            self.states.running_slot(request.request_id),
            self._restores.pop(request.request_id, None),
        )

    def plan_snapshot(self, request: Request, num_tokens_after: int) -> int | None:
        """The snapshot slot to copy the request's state into after this step, which brings
        it to `num_tokens_after` computed tokens; None unless that ends a full block of its
        prompt, before its last token, whose prefix has no snapshot yet (and a slot is free).
        A hit never covers a request's last token, so a snapshot there would only serve
        longer prompts; the block before it (where the final chunk was split) serves those
        too without filling the pool twice per request."""
        if not self.aligns_chunks or request.sampling_params.prompt_logprobs is not None:
            return None
        assert self.states is not None
        if num_tokens_after % self.block_size or not (
            0 < num_tokens_after < request.num_prompt_tokens
        ):
            return None
        block_hash = self.block_hashes(request, num_tokens_after)[-1]
        return self.states.reserve_snapshot(request.request_id, block_hash)

    def has_snapshot(self, request: Request, num_tokens: int) -> bool:
        """Whether the prefix of the request's first `num_tokens` (a block multiple) has a
        cached state snapshot."""
        if self.states is None or num_tokens < self.block_size:
            return False
        return self.states.has_snapshot(self.block_hashes(request, num_tokens)[-1])

    def cached_prefix_end(self, request: Request, start: int) -> int:
        """Where the request's KV chain stops being cached, walking from token `start` (a block
        multiple) up to its last full block before its last token. Hybrid prefills stop a
        chunk there: that is where another request's prefix ended, so a later request with
        the same prefix may resume from a state snapshot taken there."""
        hashes = self.block_hashes(request, request.num_schedulable_tokens - 1)
        i = start // self.block_size
        while i < len(hashes) and self.pool.lookup(hashes[i]) is not None:
            i += 1
        return max(i * self.block_size, start)

    def end_step(self) -> None:
        """The step scheduled last has run: release what only it needed (restore pins)."""
        self._restores.clear()
        if self.states is not None:
            self.states.end_step()

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
        states = self.states
        rid = request.request_id
        if states is not None and states.running_slot(rid) is None:
            if not states.has_free_running_slot():
                return None
            restore_hash = None
            if computed_blocks:
                restore_hash = self.block_hashes(request, len(computed_blocks) * self.block_size)[
                    -1
                ]
            restore = states.acquire(rid, restore_hash)[1]
            # get_computed_blocks only hits where a snapshot is cached, and nothing evicts
            # between that lookup and this allocation.
            assert restore is not None or not computed_blocks, "state hit without snapshot"
            self._restores[rid] = restore
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
        if self.states is not None:
            self.states.release(request.request_id)
            self._restores.pop(request.request_id, None)
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
            state=None if self.states is None else self.states.stats(),
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
            block_hash = pool.block_hashes[b]
            snapshot = (
                self.states is not None
                and block_hash is not None
                and self.states.has_snapshot(block_hash)
            )
            owners_b = tuple(owners.get(b, ()))
            view.append(BlockInfo(b, state, pool.ref_counts[b], owners_b, snapshot))
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
