"""KVCacheManager: which blocks each request holds, and allocation with lookahead."""

from __future__ import annotations

from tinyvllm.core.block_pool import BlockPool
from tinyvllm.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[int] | None:
        """Make room for `num_new_tokens` (+ lookahead for draft tokens) beyond the computed ones.

        Returns the newly added block ids, or None when the pool cannot cover them (the caller
        then preempts or waits); nothing is allocated in that case.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = self.num_blocks_needed(total) - len(blocks)
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            if not blocks:
                del self._blocks[request.request_id]
            return None
        new_blocks = self.pool.allocate(needed)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])
