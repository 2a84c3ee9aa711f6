"""BlockPool: the fixed set of KV blocks, their reference counts, the free queue, and the
prefix cache (block hash -> block holding that KV).

A block is in exactly one of three states: in use (ref count > 0), cached-free (ref count 0
but holding the KV of a known hash, so a later request with the same prefix can take it back),
or plain free. Allocation takes, in this order: plain free blocks that have held KV before (in
the order they were freed), blocks never handed out yet (by id), and only then cached-free
blocks, least recently used first, forgetting their hash (eviction). A hit on a cached-free
block takes it out of its queue again.

Why used blocks before fresh ones: the CPU KV cache is lazily zeroed memory that the OS maps on
first write. A free queue that handed out every fresh block before reusing one made each new
request fault in new pages (a 4,096-token prefill of a SmolLM2-135M-shaped model: 23k page
faults, ~28 ms of a ~0.93 s step) until the whole cache had been touched once, and made the
cache resident in full over time. Reusing plain free blocks first keeps the resident part at
the peak in use and loses no cached prefix (fresh blocks still go before any eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes

# The hash of "no parent": the first block of every sequence chains from this.
ROOT_HASH: BlockHash = b"\x00" * 32


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> BlockHash:
    """SHA-256 over the parent hash, the block's token ids and extra keys.

    The chain makes a hash stand for the whole prefix, not just one block; extra keys carry
    whatever else changes the KV (multimodal item hashes, adapter ids). A cryptographic hash
    means two different prefixes never share a block in practice, so a hit needs no token
    comparison.
    """
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass(frozen=True)
class BlockPoolStats:
    """The pool's own counts at one moment (`BlockPool.stats()`)."""

    num_blocks: int
    num_used_blocks: int  # ref count > 0
    num_cached_free_blocks: int  # free, but holding reusable cached KV
    num_evictions: int  # cached blocks reused for other content, lifetime

    @property
    def num_free_blocks(self) -> int:
        """Neither used nor holding cached content."""
        return self.num_blocks - self.num_used_blocks - self.num_cached_free_blocks


class BlockPool:
    """Owns block ids `0..num_blocks-1`."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # Free blocks by kind (see the module docstring); each queue in allocation order.
        self._plain: OrderedDict[int, None] = OrderedDict()
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._next_fresh = 0  # blocks [_next_fresh, num_blocks) were never handed out
        self.num_cached_free = 0
        self.num_evictions = 0
        # Told each hash the pool forgets by eviction (hybrid models drop the recurrent-state
        # snapshot stored under it).
        self.on_evict: Callable[[BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (plain free plus cached-free, which it evicts)."""
        return len(self._plain) + len(self._cached_free) + self.num_blocks - self._next_fresh

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            self.num_blocks, self.num_used_blocks, self.num_cached_free, self.num_evictions
        )

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each), evicting cached ones in LRU order.

        The caller checks availability first.
        """
        free = self.num_free_blocks
        if n > free:
            raise RuntimeError(f"asked for {n} blocks with only {free} free")
        blocks = []
        for _ in range(n):
            if self._plain:
                block_id, _ = self._plain.popitem(last=False)
            elif self._next_fresh < self.num_blocks:
                block_id = self._next_fresh
                self._next_fresh += 1
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                self._evict(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free queue.

        Callers pass a request's blocks in reverse order so that a request's tail blocks are
        evicted before its head blocks, which other requests are more likely to share.
        """
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                if self.block_hashes[block_id] is None:
                    self._plain[block_id] = None
                else:
                    self._cached_free[block_id] = None
                    self.num_cached_free += 1

    # ---- prefix cache -----------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference to cache hits; a hit that was free leaves the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._cached_free[block_id]
                self.num_cached_free -= 1
            self.ref_counts[block_id] += 1

    def refresh(self, block_ids: Iterable[int]) -> None:
        """Mark free cached blocks as just used (the back of the LRU queue) without taking
        them: content a lookup found but could not use yet, kept from early eviction."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                self._cached_free.move_to_end(block_id)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that `block_id` (in use, KV fully written) holds the KV of `block_hash`.

        When another block already holds the same content, the first one stays the cached
        copy and this one remains private to its request.
        """
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self.cached:
            return
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id

    def forget(self, block_hash: BlockHash) -> None:
        """Drop `block_hash` from the cache; its block keeps its place (and owners) but is
        plain content now."""
        block_id = self.cached.pop(block_hash, None)
        if block_id is None:
            return
        self.block_hashes[block_id] = None
        if self.ref_counts[block_id] == 0:
            del self._cached_free[block_id]
            self._plain[block_id] = None
            self.num_cached_free -= 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their KV for their owners).

        Returns the number of hashes dropped.
        """
        dropped = len(self.cached)
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        self._plain.update(self._cached_free)
        self._cached_free.clear()
        self.num_cached_free = 0
        return dropped

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        self.block_hashes[block_id] = None
        if block_hash is not None and self.cached.get(block_hash) == block_id:
            del self.cached[block_hash]
        self.num_cached_free -= 1
        self.num_evictions += 1
        if block_hash is not None and self.on_evict is not None:
            self.on_evict(block_hash)

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests and debugging)."""
        for block_id in range(self.num_blocks):
            count = self.ref_counts[block_id]
            assert count >= 0, f"block {block_id} has ref count {count}"
            queued = block_id in self._plain or block_id in self._cached_free
            fresh = block_id >= self._next_fresh
            assert (count == 0) == (queued or fresh), f"block {block_id} free-queue state"
            assert not (queued and fresh), f"block {block_id} both queued and fresh"
            assert (block_id in self._cached_free) == (
                count == 0 and self.block_hashes[block_id] is not None
            ), f"block {block_id} in the wrong free queue"
        for block_hash, block_id in self.cached.items():
            assert self.block_hashes[block_id] == block_hash, f"block {block_id} hash mismatch"
        hashed = [b for b in range(self.num_blocks) if self.block_hashes[b] is not None]
        assert len(hashed) == len(self.cached), "hashed blocks missing from the cache map"
        cached_free = sum(1 for b in hashed if self.ref_counts[b] == 0)
        assert cached_free == self.num_cached_free, "cached-free count drifted"
