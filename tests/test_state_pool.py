"""Recurrent-state slots of hybrid models (core/state_pool.py) and the scheduler's "align"
mode: running slots never leak, snapshots are taken only where chunks end on block
boundaries, cached only after the step that wrote them, restored on hits and dropped with
their KV blocks. Pure Python, no model."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import check_invariants, fake_run

from tinyvllm.config import SchedulerConfig
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams

BS = 4


def hybrid_scheduler(
    num_blocks: int = 64, caching: bool = True, snapshots: int = 8, **kw: object
) -> Scheduler:
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 64, "max_model_len": 256, **kw})
    kv = KVCacheManager(
        num_blocks, BS, caching, num_running_states=cfg.max_num_seqs,
        num_snapshot_states=snapshots,
    )  # fmt: skip
    return Scheduler(cfg, kv)


def req(rid: str, tokens: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), 2, max_tokens)


def step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, fake_run(out, s))
    check_invariants(s)
    return out


def test_running_slot_held_from_admission_to_finish() -> None:
    s = hybrid_scheduler()
    s.add_request(req("a", range(10, 16)))
    out = s.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.state_slot is not None and new.restore_state_slot is None
    assert s.kv.states.running_slot("a") == new.state_slot
    s.update_from_output(out, fake_run(out, s))
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.states.running_slot("a") is None
    assert s.kv.states.stats().num_used_running_slots == 0


def test_chunks_end_on_block_boundaries_and_prompt_tail_is_split() -> None:
    s = hybrid_scheduler(max_num_batched_tokens=10)
    s.add_request(req("a", range(10, 33)))  # 23 tokens
    sizes, snaps = [], []
    while s.requests["a"].num_computed_tokens < 23:
        out = step(s)
        sizes.append(out.num_scheduled_tokens["a"])
        snaps.append("a" in out.state_snapshots)
    # Budget 10 -> chunks of 8 (boundaries 8, 16); the last full block before the final
    # token is 20, so 4 more, then the tail of 3 (a snapshot at the very end never hits).
    assert sizes == [8, 8, 4, 3]
    assert snaps == [True, True, True, False]
    assert s.kv.states.stats().num_cached_snapshots == 3


def test_identical_prompt_restores_last_snapshot_and_hits_count() -> None:
    s = hybrid_scheduler()
    prompt = list(range(10, 31))  # 21 tokens: snapshot at 20
    s.add_request(req("a", prompt))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(req("b", prompt))
    out = s.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 20
    assert new.restore_state_slot is not None
    assert new.restore_state_slot >= s.kv.states.num_running  # a snapshot slot
    assert out.num_scheduled_tokens["b"] == 1
    # Pinned while the step runs, so nothing can evict it before the runner copies it.
    s.kv.states.check_invariants(set(s.kv._blocks))
    assert s.kv.states.snapshots.ref_counts[new.restore_state_slot - s.kv.states.num_running]
    s.update_from_output(out, fake_run(out, s))
    assert s.kv.states.stats().num_restores == 1
    assert s.kv.counters.hits == 20


def test_chunk_stops_where_a_cached_prefix_ends_so_later_requests_hit_it() -> None:
    """The shared prefix (12 tokens) ends mid-prompt for everyone, so no prompt's own
    boundaries snapshot it; the second request stops its first chunk where the KV cache's
    copy of its prefix ends, and the third resumes from that snapshot."""
    s = hybrid_scheduler()
    system = list(range(10, 22))
    s.add_request(req("a", system + [50] * 7))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(req("b", system + [60] * 7))
    out = step(s)
    assert out.num_scheduled_tokens["b"] == 12 and "b" in out.state_snapshots
    while s.has_unfinished_requests():
        step(s)
    s.add_request(req("c", system + [70] * 7))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.scheduled_new_reqs[0].restore_state_slot is not None


def test_a_shared_prefix_recomputed_for_its_snapshot_is_not_evicted_meanwhile() -> None:
    """The cached KV of a shared prefix that a request must recompute (no snapshot there yet)
    is kept recent, so allocations evict other free blocks and the requests waiting for the
    new snapshot still find the whole prefix."""
    s = hybrid_scheduler(num_blocks=10)  # a and c fill every block, a's first
    system = list(range(10, 22))
    for rid, prompt in (("a", system + [50] * 8), ("c", list(range(100, 120)))):
        s.add_request(req(rid, prompt, max_tokens=1))
        while s.has_unfinished_requests():
            step(s)
    s.add_request(req("w8", system + [60] * 8, max_tokens=1))
    s.add_request(req("w9", system + [70] * 8, max_tokens=1))
    out = step(s)
    assert list(out.num_scheduled_tokens) == ["w8"]  # w9 waits for w8's snapshot at 12
    out = step(s)
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["w9"].num_computed_tokens == 12 and new["w9"].restore_state_slot is not None


def test_kv_hits_without_a_snapshot_do_not_count() -> None:
    s = hybrid_scheduler()
    s.add_request(req("a", list(range(10, 30))))  # snapshots at 16 (tail split) and 20
    while s.has_unfinished_requests():
        step(s)
    # Shares 12 tokens (3 cached KV blocks) with a, but a has no snapshot at 4, 8 or 12.
    s.add_request(req("b", list(range(10, 22)) + [99] * 9))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.scheduled_new_reqs[0].restore_state_slot is None


def test_same_step_never_restores_an_unwritten_snapshot() -> None:
    s = hybrid_scheduler()
    prompt = list(range(10, 31))
    s.add_request(req("a", prompt))
    s.add_request(req("b", prompt))
    out = s.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]  # b waits for a's snapshot
    s.update_from_output(out, fake_run(out, s))
    out = s.schedule()
    new_b = next(n for n in out.scheduled_new_reqs if n.req_id == "b")
    assert new_b.num_computed_tokens == 20 and new_b.restore_state_slot is not None


def test_evicting_a_block_drops_its_snapshot_and_reset_drops_all() -> None:
    s = hybrid_scheduler(num_blocks=8)
    s.add_request(req("a", list(range(10, 31)), max_tokens=1))
    while s.has_unfinished_requests():
        step(s)
    a_hash = s.kv.block_hashes(req("x", list(range(10, 31))), 20)[-1]
    assert s.kv.states.has_snapshot(a_hash)  # the prompt's last full block (20 tokens)
    # A different 30-token prompt needs every block: a's cached blocks are evicted.
    s.add_request(req("b", list(range(100, 130)), max_tokens=1))
    step(s)
    assert not s.kv.states.has_snapshot(a_hash)
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.states.stats().num_cached_snapshots > 0
    s.kv.reset_prefix_cache()
    assert s.kv.states.stats().num_cached_snapshots == 0


def test_state_caching_off_runs_without_snapshots() -> None:
    s = hybrid_scheduler(caching=False, snapshots=0, max_num_batched_tokens=10)
    s.add_request(req("a", range(10, 33)))
    out = step(s)
    assert out.num_scheduled_tokens["a"] == 10 and not out.state_snapshots


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "step", "abort", "reset"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=120,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=OPS,
    num_blocks=st.integers(6, 24),
    budget=st.sampled_from([3, 4, 9, 32]),
    snapshots=st.integers(0, 4),
    max_num_seqs=st.integers(1, 4),
)
def test_random_hybrid_operations_keep_invariants(
    ops: list[tuple[str, int]], num_blocks: int, budget: int, snapshots: int, max_num_seqs: int
) -> None:
    """Random add/step/abort/reset with shared prefixes, preemption and snapshot pressure:
    every running request holds one slot, no slot or snapshot leaks, and every hit ends on
    a block whose snapshot is cached."""
    s = hybrid_scheduler(
        num_blocks, snapshots=snapshots, max_num_batched_tokens=budget,
        max_model_len=num_blocks * BS, max_num_seqs=max_num_seqs,
    )  # fmt: skip
    n = 0
    for op, arg in ops:
        rng = random.Random(arg)
        if op == "add":
            length = rng.randint(1, min(20, num_blocks * BS - 2))
            tokens = [rng.choice([5, 6]) for _ in range(length)]
            s.add_request(req(str(n), tokens, rng.randint(1, 5)))
            n += 1
        elif op == "step":
            out = s.schedule()
            for new in out.scheduled_new_reqs:
                assert new.num_computed_tokens % BS == 0
                assert (new.restore_state_slot is None) == (new.num_computed_tokens == 0)
            s.update_from_output(out, fake_run(out, s))
        elif op == "abort" and s.requests:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        elif op == "reset":
            s.kv.reset_prefix_cache()
        check_invariants(s)
    while s.has_unfinished_requests():
        step(s)
    s.schedule()  # releases the last step's pins
    states = s.kv.states
    assert states.stats().num_used_running_slots == 0
    if states.snapshots is not None:
        assert states.snapshots.num_free_blocks == states.snapshots.num_blocks
