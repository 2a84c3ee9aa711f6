"""BlockPool: the fixed set of KV blocks, their reference counts and the free queue."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Owns block ids `0..num_blocks-1`.

    Free blocks sit in an insertion-ordered queue; allocation pops from the front and freeing
    appends to the back, so the front is always the least recently freed block (the LRU order
    prefix caching evicts in).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each); the caller checks availability first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: list[int]) -> None:
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
                self._free[block_id] = None
