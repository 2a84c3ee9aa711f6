"""StatePool: the recurrent-state slots of hybrid models (short-conv / Mamba layers), managed
beside the KV blocks.

A slot is one request's whole recurrent state (every mixer layer's conv window and SSM state);
the runner holds the tensors, this pool only hands out slot ids. Two kinds of slot:

- running slots `0..num_running-1`: one per running request, taken on admission and given
  back on finish, abort or preemption;
- snapshot slots `num_running..num_slots-1`: the prefix cache of recurrent state ("align"
  mode). The state after a prefill chunk that ends on a block boundary is copied into a
  snapshot slot and cached under that block's hash, so that a later request whose prefix
  hits that block starts from a copy of it. They reuse `BlockPool` (ref counts, LRU free
  queue, hash map): a snapshot is reserved when the step that computes it is scheduled,
  cached only after that step ran (nobody reads a snapshot before it is written), pinned
  while a restore copies it, and forgotten when the KV block of its hash is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.core.block_pool import BlockHash, BlockPool


@dataclass(frozen=True)
class StatePoolStats:
    """The pool's own counts at one moment (`StatePool.stats()`)."""

    num_running_slots: int
    num_used_running_slots: int
    num_snapshot_slots: int
    num_cached_snapshots: int  # snapshots a prefix hit can restore
    num_restores: int  # requests that started from a snapshot, lifetime
    num_snapshots_taken: int  # snapshots cached, lifetime


class StatePool:
    def __init__(self, num_running: int, num_snapshots: int, enable_caching: bool) -> None:
        if num_running < 1:
            raise ValueError(
                f"a hybrid model needs at least one running state slot, got {num_running}"
            )
        self.num_running = num_running
        self._free_running = list(range(num_running - 1, -1, -1))
        self._running: dict[str, int] = {}
        self.snapshots = BlockPool(num_snapshots, enable_caching) if num_snapshots else None
        # Per request: the snapshot slot (pool id) reserved for this step and its hash.
        self._pending: dict[str, tuple[int, BlockHash]] = {}
        # Snapshot slots (pool ids) pinned until the step that restores them has run.
        self._pinned: list[int] = []
        self.num_restores = 0
        self.num_snapshots_taken = 0

    @property
    def num_slots(self) -> int:
        return self.num_running + (self.snapshots.num_blocks if self.snapshots else 0)

    @property
    def caching(self) -> bool:
        return self.snapshots is not None and self.snapshots.enable_caching

    # ---- running slots ----------------------------------------------------------------------
    def running_slot(self, request_id: str) -> int | None:
        return self._running.get(request_id)

    def has_free_running_slot(self) -> bool:
        return bool(self._free_running)

    def acquire(self, request_id: str, restore_hash: BlockHash | None) -> tuple[int, int | None]:
        """A running slot for a newly admitted request, plus the snapshot slot to restore from
        (pinned until `end_step`) when `restore_hash` names a cached snapshot. The caller
        checks `has_free_running_slot` first."""
        if request_id in self._running:
            raise RuntimeError(f"request {request_id!r} already holds state slot")
        slot = self._free_running.pop()
        self._running[request_id] = slot
        restore = None
        if restore_hash is not None and self.snapshots is not None:
            snap = self.snapshots.lookup(restore_hash)
            if snap is not None:
                self.snapshots.touch([snap])
                self._pinned.append(snap)
                self.num_restores += 1
                restore = self.num_running + snap
        return slot, restore

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: its running slot and any snapshot
        reserved for it and not yet taken go back."""
        slot = self._running.pop(request_id, None)
        if slot is not None:
            self._free_running.append(slot)
        pending = self._pending.pop(request_id, None)
        if pending is not None and self.snapshots is not None:
            self.snapshots.free([pending[0]])

    # ---- snapshots --------------------------------------------------------------------------
    def has_snapshot(self, block_hash: BlockHash) -> bool:
        return self.snapshots is not None and self.snapshots.lookup(block_hash) is not None

    def reserve_snapshot(self, request_id: str, block_hash: BlockHash) -> int | None:
        """A slot (global id) the runner copies `request_id`'s state into after this step;
        None when caching is off, the hash has a snapshot already, or every snapshot slot is
        reserved or pinned (then this boundary is simply not cached)."""
        pool = self.snapshots
        if (
            pool is None
            or not pool.enable_caching
            or request_id in self._pending
            or pool.lookup(block_hash) is not None
            or pool.num_free_blocks == 0
        ):
            return None
        (snap,) = pool.allocate(1)
        self._pending[request_id] = (snap, block_hash)
        return self.num_running + snap

    def commit(self, request_id: str) -> None:
        """The step that wrote `request_id`'s reserved snapshot has run: cache it."""
        pending = self._pending.pop(request_id, None)
        if pending is None or self.snapshots is None:
            return
        snap, block_hash = pending
        if self.snapshots.lookup(block_hash) is None:
            self.snapshots.cache_block(snap, block_hash)
            self.num_snapshots_taken += 1
        self.snapshots.free([snap])  # cached-free: restorable until evicted

    def end_step(self) -> None:
        """Unpin the snapshots restored by the step that just ran."""
        if self._pinned and self.snapshots is not None:
            self.snapshots.free(self._pinned)
        self._pinned = []

    def forget(self, block_hash: BlockHash) -> None:
        """The KV block of `block_hash` was evicted: its snapshot can never hit again."""
        if self.snapshots is not None:
            self.snapshots.forget(block_hash)

    def reset_prefix_cache(self) -> None:
        if self.snapshots is not None:
            self.snapshots.reset_prefix_cache()

    # ---- views ------------------------------------------------------------------------------
    def stats(self) -> StatePoolStats:
        pool = self.snapshots
        return StatePoolStats(
            num_running_slots=self.num_running,
            num_used_running_slots=len(self._running),
            num_snapshot_slots=0 if pool is None else pool.num_blocks,
            num_cached_snapshots=0 if pool is None else len(pool.cached),
            num_restores=self.num_restores,
            num_snapshots_taken=self.num_snapshots_taken,
        )

    def check_invariants(self, running_request_ids: set[str] | None = None) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests and debugging).

        `running_request_ids`: the requests that hold blocks; each must hold exactly one slot.
        """
        slots = list(self._running.values())
        assert len(set(slots)) == len(slots), "a running slot is held twice"
        assert not set(slots) & set(self._free_running), "a running slot is both held and free"
        assert len(slots) + len(self._free_running) == self.num_running, "running slot leaked"
        if running_request_ids is not None:
            assert set(self._running) == running_request_ids, (
                f"state slots held by {sorted(self._running)}, blocks by "
                f"{sorted(running_request_ids)}"
            )
        pool = self.snapshots
        if pool is None:
            assert not self._pending and not self._pinned, "snapshots without a snapshot pool"
            return
        pool.check_invariants()
        held = [snap for snap, _ in self._pending.values()] + self._pinned
        refs = [0] * pool.num_blocks
        for snap in held:
            refs[snap] += 1
        assert refs == pool.ref_counts, "snapshot ref counts drifted from reservations/pins"
