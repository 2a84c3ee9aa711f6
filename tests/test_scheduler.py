"""Scheduler, KV-cache manager and block pool invariants, without torch."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from tinyvllm.config import SchedulerConfig
from tinyvllm.core.block_pool import BlockPool, BlockPoolStats
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from tinyvllm.core.scheduler import Scheduler, SchedulerStats
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams

EOS = 2


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, **kw: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(rid, list(range(3, 3 + prompt_len)), params, EOS, max_tokens)


def fake_run(sched: SchedulerOutput, scheduler: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """Sample `token` for every request whose scheduled tokens reach the end of what it has."""
    req_ids = list(sched.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def check_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    pool = kv.pool
    held: dict[int, int] = {}
    for rid, blocks in kv._blocks.items():
        assert rid in scheduler.requests, f"blocks leaked by finished request {rid}"
        assert len(set(blocks)) == len(blocks), "a block appears twice in one request"
        for b in blocks:
            held[b] = held.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == held.get(b, 0)
    assert pool.num_free_blocks + len(held) == pool.num_blocks
    for req in scheduler.running:
        assert req.status == RequestStatus.RUNNING
        assert len(kv.get_block_ids(req.request_id)) * kv.block_size >= req.num_computed_tokens
    for req in scheduler.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    pool.check_invariants()
    if kv.states is not None:  # hybrid: exactly the requests holding blocks hold a state slot
        kv.states.check_invariants(set(kv._blocks))


def make_scheduler(num_blocks: int, enable_caching: bool = False, **kw: object) -> Scheduler:
    """Prefix caching is off unless asked: these prompts share tokens on purpose."""
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 64, "max_model_len": 256, **kw})
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size=4, enable_caching=enable_caching))


def test_block_pool_lru_and_double_free() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.num_free_blocks == 0
    pool.free(b[::-1])
    pool.free(a[::-1])
    # Freed order is the eviction order: b's tail first, a's head last.
    assert pool.allocate(4) == [b[1], b[0], a[1], a[0]]
    pool.free([0])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([0])


def test_chunked_prefill_respects_budget() -> None:
    s = make_scheduler(64, max_num_batched_tokens=16)
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 5))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    s.update_from_output(out, fake_run(out, s))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    s.update_from_output(out, fake_run(out, s))
    out = s.schedule()
    # a finishes its prompt (8 tokens), b joins with the rest of the budget.
    assert out.num_scheduled_tokens == {"a": 8, "b": 5}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    s.update_from_output(out, fake_run(out, s))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_without_chunked_prefill_prompt_waits_for_budget() -> None:
    s = make_scheduler(64, max_num_batched_tokens=40, enable_chunked_prefill=False)
    s.add_request(make_request("a", 30))
    s.add_request(make_request("b", 20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 30}


def test_preemption_frees_and_requeues_at_front() -> None:
    # Like the engine guarantees, the pool holds one max_model_len sequence (6 x 4 = 24).
    s = make_scheduler(6, max_num_batched_tokens=64, max_model_len=24)
    s.add_request(make_request("a", 8, max_tokens=20))
    s.add_request(make_request("b", 8, max_tokens=20))
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    s.update_from_output(out, fake_run(out, s))
    preempted = False
    for _ in range(10):
        out = s.schedule()
        check_invariants(s)
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"b"}
            assert s.waiting[0].request_id == "b"
            assert s.waiting[0].num_computed_tokens == 0
            preempted = True
            s.update_from_output(out, fake_run(out, s))
            break
        s.update_from_output(out, fake_run(out, s))
    assert preempted
    # b comes back as a new request carrying its generated tokens.
    while s.has_unfinished_requests():
        out = s.schedule()
        for new in out.scheduled_new_reqs:
            if new.req_id == "b":
                assert new.output_token_ids and new.num_computed_tokens == 0
        s.update_from_output(out, fake_run(out, s))
        check_invariants(s)
    assert s.kv.pool.num_free_blocks == 6


def test_stop_conditions() -> None:
    s = make_scheduler(64)
    s.add_request(make_request("eos", 4, max_tokens=10))
    s.add_request(make_request("min", 4, max_tokens=10, min_tokens=3))
    s.add_request(make_request("len", 4, max_tokens=2))
    finished: dict[str, tuple[RequestStatus, int]] = {}
    while s.has_unfinished_requests():
        out = s.schedule()
        for upd in s.update_from_output(out, fake_run(out, s, token=EOS)):
            if upd.finished:
                finished[upd.request.request_id] = (
                    upd.request.status,
                    upd.request.num_output_tokens,
                )
    assert finished["eos"] == (RequestStatus.FINISHED_STOPPED, 1)
    assert finished["min"] == (RequestStatus.FINISHED_STOPPED, 3)
    assert finished["len"] == (RequestStatus.FINISHED_STOPPED, 1)


def test_max_model_len_caps_generation() -> None:
    s = make_scheduler(64, max_model_len=10)
    s.add_request(make_request("a", 8, max_tokens=100))
    n = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        for upd in s.update_from_output(out, fake_run(out, s)):
            n += len(upd.new_token_ids)
            if upd.finished:
                assert upd.request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert n == 2


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_invariants(seed: int, caching: bool) -> None:
    rng = random.Random(seed)
    s = make_scheduler(
        rng.randint(16, 40),
        enable_caching=caching,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([1, 3, 8]),
        max_model_len=64,
    )
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25:
            s.add_request(make_request(str(next_id), rng.randint(1, 40), rng.randint(1, 20)))
            next_id += 1
        elif op < 0.32 and s.requests:
            victim = rng.choice(list(s.requests))
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        else:
            out = s.schedule()
            assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
            token = EOS if rng.random() < 0.05 else 7
            s.update_from_output(out, fake_run(out, s, token))
        check_invariants(s)
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, fake_run(out, s))
        check_invariants(s)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    assert all(c == 0 for c in s.kv.pool.ref_counts)


def test_core_does_not_import_torch() -> None:
    code = (
        "import sys, tinyvllm.core.scheduler, tinyvllm\n"
        "assert 'torch' not in sys.modules, 'core imported torch'\n"
        "assert 'textual' not in sys.modules, 'tinyvllm imported textual'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_owners_report_their_own_stats() -> None:
    s = make_scheduler(6, enable_caching=True, max_model_len=24)
    for rid in "ab":
        s.add_request(make_request(rid, 8, max_tokens=20))
    out = s.schedule()  # b waits for a's in-flight prefix
    s.update_from_output(out, fake_run(out, s))
    assert s.stats() == SchedulerStats(1, 1, 0, 0)
    out = s.schedule()  # b takes a's first block from the cache
    s.update_from_output(out, fake_run(out, s))
    kv = s.kv.stats(include_blocks=True)
    assert kv.pool == BlockPoolStats(
        num_blocks=6, num_used_blocks=4, num_cached_free_blocks=0, num_evictions=0
    )
    assert (kv.block_size, kv.prefix_queries, kv.prefix_hits) == (4, 16, 4)
    assert [b.ref_count for b in kv.blocks if b.state == "used"] == [2, 1, 1, 1]
    assert s.kv.stats().blocks == () and s.stats() == SchedulerStats(2, 0, 0, 0)
    while not s.num_preemptions:
        out = s.schedule()
        s.update_from_output(out, fake_run(out, s))
    assert s.stats() == SchedulerStats(
        num_running=1, num_waiting=1, num_preempted_waiting=1, total_preemptions=1
    )
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    pool = s.kv.stats().pool
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks + pool.num_cached_free_blocks == 6
