"""Prefix caching: block hashing, the cached-free LRU, the scheduler's use of hits, and
greedy outputs that do not change when it is on."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import check_invariants, fake_run, make_scheduler

from tinyvllm import LLM, SamplingParams
from tinyvllm.core.block_pool import ROOT_HASH, BlockPool, hash_block
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.request import Request, RequestStatus

BS = 4


def req(rid: str, tokens: list[int], max_tokens: int = 4, **kw: object) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **kw), 2, max_tokens)


def step(s) -> object:
    out = s.schedule()
    s.update_from_output(out, fake_run(out, s))
    check_invariants(s)
    return out


# ---- hashing and the pool --------------------------------------------------------------------
def test_hash_covers_tokens_parent_and_extra_keys() -> None:
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 4], extra_keys=("image:abc",))
    # Large ids must not collide through truncation.
    assert hash_block(ROOT_HASH, [2**40]) != hash_block(ROOT_HASH, [0])


def test_block_hashes_key_on_media_content() -> None:
    """Placeholder tokens are the same for any picture of one size: blocks overlapping an
    item hash its content (and where in the item they are); blocks before it do not."""
    from tinyvllm.request import MultiModalFeature

    kv = KVCacheManager(16, BS)
    tokens = [1, 2, 3, 4] + [9] * 8 + [5, 6]

    def hashes(identifier: str, offset: int = 4) -> list[bytes]:
        r = req("r", tokens)
        r.mm_features = [MultiModalFeature("image", identifier, offset, 8)]
        return kv.block_hashes(r, len(tokens))

    same, other = hashes("cat"), hashes("dog")
    assert same == hashes("cat")
    assert same[0] == other[0] and same[1] != other[1] and same[2] != other[2]
    assert same[0] == kv.block_hashes(req("t", tokens), len(tokens))[0]
    # The same item shifted by one token is other KV too.
    assert hashes("cat", offset=5)[1] != same[1]


def test_cached_free_blocks_are_reused_then_evicted_in_lru_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free(blocks[::-1])
    assert pool.num_free_blocks == 4 and pool.num_cached_free == 3
    # A hit takes the block out of the free queue and raises its ref count.
    hit = pool.lookup(bytes([1]) * 32)
    assert hit == blocks[1]
    pool.touch([hit])
    assert pool.ref_counts[hit] == 1 and pool.num_free_blocks == 3
    pool.touch([hit])
    assert pool.ref_counts[hit] == 2
    # Allocation takes the never-used block first, then evicts the least recently freed.
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(bytes([2]) * 32) is None and pool.num_evictions == 1
    assert pool.lookup(bytes([0]) * 32) == blocks[0]
    pool.check_invariants()


def test_used_plain_blocks_go_before_fresh_ones_and_fresh_before_evictions() -> None:
    # The CPU KV cache maps its pages on first write: a block that held KV before is reused
    # before a never-used one (no page faults in the step), and a never-used one before a
    # cached prefix is evicted.
    pool = BlockPool(8)
    cached, plain = pool.allocate(2), pool.allocate(2)
    pool.cache_block(cached[0], b"\x01" * 32)
    pool.free(cached[::-1])
    pool.free(plain[::-1])
    # cached[1] held no hash: plain free since it was freed (first).
    assert pool.allocate(3) == [cached[1], plain[1], plain[0]]
    assert pool.allocate(4) == [4, 5, 6, 7]
    assert pool.num_evictions == 0 and pool.lookup(b"\x01" * 32) == cached[0]
    assert pool.allocate(1) == [cached[0]] and pool.num_evictions == 1
    pool.check_invariants()


def test_forgotten_and_reset_blocks_are_reused_before_fresh_ones() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free(blocks)
    pool.forget(bytes([2]) * 32)
    assert pool.allocate(1) == [blocks[2]] and pool.num_evictions == 0
    pool.reset_prefix_cache()
    pool.check_invariants()
    assert pool.allocate(2) == blocks[:2]
    assert pool.allocate(1) == [3]
    pool.check_invariants()


def test_duplicate_content_keeps_first_copy() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"x" * 32)
    pool.cache_block(b, b"x" * 32)
    assert pool.lookup(b"x" * 32) == a and pool.block_hashes[b] is None
    pool.check_invariants()


# ---- scheduler + manager -----------------------------------------------------------------------
def test_hit_skips_cached_prefix_and_counts() -> None:
    s = make_scheduler(32, enable_caching=True)
    prefix = list(range(10, 22))  # three full blocks
    s.add_request(req("a", [*prefix, 50, 51]))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(req("b", [*prefix, 60]))
    out = step(s)
    # b's three prefix blocks are hits; only its last token runs.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens == {"b": 1}
    assert s.requests["b"].num_cached_tokens == 12
    assert s.kv.counters.hits == 12 and s.kv.counters.queries == 14 + 13


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    s = make_scheduler(32, enable_caching=True)
    prompt = list(range(10, 18))  # exactly two blocks
    s.add_request(req("a", prompt))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(req("b", prompt))
    out = step(s)
    # Only whole blocks are reused and the last token is never a hit: block 2 is recomputed.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens["b"] == 4
    s.add_request(req("c", [*prompt, 30]))
    out = step(s)
    assert out.num_scheduled_tokens["c"] == 1


def test_same_prefix_in_one_step_waits_for_the_kv_instead_of_reading_it_early() -> None:
    s = make_scheduler(32, enable_caching=True)
    prefix = list(range(10, 22))
    s.add_request(req("a", [*prefix, 1]))
    s.add_request(req("b", [*prefix, 2]))
    s.add_request(req("z", [90, 91, 92, 93, 94]))
    out = s.schedule()
    # b's next block is being computed by a this very step: b (and FCFS behind it) waits
    # rather than computing the same prefix again or reading KV that nobody wrote yet.
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    assert not s.kv.pool.cached  # nothing counts as cached until the step has run
    s.update_from_output(out, fake_run(out, s))
    assert len(s.kv.pool.cached) == 3
    out = step(s)
    new = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert new == {"b": 12, "z": 0}
    assert s.kv.get_block_ids("a")[:3] == s.kv.get_block_ids("b")[:3]
    assert s.kv.counters.requests == 3 and s.kv.counters.hits == 12


def test_prefix_without_caching_runs_together() -> None:
    s = make_scheduler(32, enable_caching=False)
    prefix = list(range(10, 22))
    s.add_request(req("a", [*prefix, 1]))
    s.add_request(req("b", [*prefix, 2]))
    out = s.schedule()
    assert {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs} == {"a": 0, "b": 0}


def test_chunked_prefill_caches_finished_chunks_only() -> None:
    s = make_scheduler(32, enable_caching=True, max_num_batched_tokens=6)
    s.add_request(req("a", list(range(10, 30))))
    step(s)  # 6 tokens computed: one full block
    assert len(s.kv.pool.cached) == 1
    step(s)  # 12 tokens: three blocks
    assert len(s.kv.pool.cached) == 3


def test_preempted_request_resumes_from_cache_without_duplicate_blocks() -> None:
    s = make_scheduler(8, enable_caching=True, max_model_len=32)
    s.add_request(req("a", list(range(10, 22)), max_tokens=12))
    s.add_request(req("b", list(range(40, 52)), max_tokens=12))
    preempted = None
    for _ in range(40):
        out = step(s)
        if out.preempted_req_ids:
            preempted = next(iter(out.preempted_req_ids))
            break
    assert preempted is not None
    resumed = False
    while s.has_unfinished_requests():
        out = step(s)
        for new in out.scheduled_new_reqs:
            if new.req_id == preempted:
                resumed = True
                assert len(set(new.block_ids)) == len(new.block_ids)
                assert new.num_computed_tokens % BS == 0
                assert new.num_computed_tokens < len(new.prompt_token_ids) + len(
                    new.output_token_ids
                )
    assert resumed
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_prompt_logprobs_requests_skip_the_cache() -> None:
    s = make_scheduler(32, enable_caching=True)
    prompt = list(range(10, 22))
    s.add_request(req("a", [*prompt, 1]))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(req("b", [*prompt, 1], prompt_logprobs=1))
    out = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_reset_prefix_cache() -> None:
    s = make_scheduler(32, enable_caching=True)
    prompt = list(range(10, 22))
    s.add_request(req("a", [*prompt, 1]))
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.reset_prefix_cache() == 4  # 13 prompt + 3 computed output tokens
    assert s.kv.pool.num_cached_free == 0
    s.add_request(req("b", [*prompt, 1]))
    out = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_block_view_states() -> None:
    s = make_scheduler(8, enable_caching=True)
    s.add_request(req("a", list(range(10, 19)), max_tokens=1))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(req("b", [1, 2, 3], max_tokens=5))
    step(s)
    states = [b.state for b in s.kv.block_view()]
    assert states.count("cached") == 2  # a's two full blocks
    assert states.count("used") == 1
    used = next(b for b in s.kv.block_view() if b.state == "used")
    assert used.request_ids == ("b",)


# ---- property tests ----------------------------------------------------------------------------
OPS = st.lists(
    st.tuples(st.sampled_from(["add", "step", "abort", "reset"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=120,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, num_blocks=st.integers(6, 24), budget=st.sampled_from([4, 9, 32]))
def test_random_cache_operations_keep_invariants(
    ops: list[tuple[str, int]], num_blocks: int, budget: int
) -> None:
    """Random add/step/abort/reset with heavy prefix sharing and preemption pressure."""
    s = make_scheduler(
        num_blocks, enable_caching=True, max_num_batched_tokens=budget, max_model_len=num_blocks * 4
    )
    n = 0
    for op, arg in ops:
        rng = random.Random(arg)
        if op == "add":
            # Prompts from a tiny alphabet share prefixes often.
            length = rng.randint(1, min(20, num_blocks * 4 - 2))
            tokens = [rng.choice([5, 6]) for _ in range(length)]
            s.add_request(req(str(n), tokens, max_tokens=rng.randint(1, 6)))
            n += 1
        elif op == "step":
            step(s)
        elif op == "abort" and s.requests:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        elif op == "reset":
            s.kv.reset_prefix_cache()
        check_invariants(s)
        for rid in s.requests:
            blocks = s.kv.get_block_ids(rid)
            assert len(set(blocks)) == len(blocks)
    while s.has_unfinished_requests():
        step(s)
    pool = s.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.num_cached_free == len(pool.cached)


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=14), max_size=12),
    num_blocks=st.integers(4, 16),
)
def test_manager_hits_are_a_prefix_of_identical_tokens(
    seqs: list[list[int]], num_blocks: int
) -> None:
    """Whatever a hit returns holds exactly the tokens the request has there."""
    kv = KVCacheManager(num_blocks, BS)
    content: dict[int, tuple[int, ...]] = {}
    for i, tokens in enumerate(seqs):
        r = req(str(i), tokens)
        hits, num = kv.get_computed_blocks(r)
        assert num == len(hits) * BS < len(tokens)
        for j, b in enumerate(hits):
            assert content[b] == tuple(tokens[j * BS : (j + 1) * BS])
        r.num_computed_tokens = num
        if kv.allocate_slots(r, len(tokens) - num, computed_blocks=hits) is None:
            continue
        r.num_computed_tokens = len(tokens)
        for j, b in enumerate(kv.get_block_ids(r.request_id)[: len(tokens) // BS]):
            content[b] = tuple(tokens[j * BS : (j + 1) * BS])
        kv.cache_computed_blocks(r)
        kv.free(r)
        kv.pool.check_invariants()


# ---- end to end ----------------------------------------------------------------------------------
def _greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_identical_with_and_without_caching(tiny_models, family: str) -> None:
    path = str(tiny_models[family])
    rng = random.Random(0)
    system = [rng.randrange(10, 200) for _ in range(37)]
    prompts = [
        system + [rng.randrange(10, 200) for _ in range(rng.randint(1, 20))] for _ in range(6)
    ]
    off = LLM(path, dtype="float32", max_model_len=128, enable_prefix_caching=False)
    on = LLM(path, dtype="float32", max_model_len=128, enable_prefix_caching=True)
    expected = _greedy_ids(off, prompts)
    # One batch (same-step sharing is deferred), then across batches (real hits).
    assert _greedy_ids(on, prompts) == expected
    before = on.engine.kv_cache_manager.counters.hits
    assert _greedy_ids(on, prompts[::-1]) == expected[::-1]
    assert on.engine.kv_cache_manager.counters.hits - before >= 6 * 32
    # A prompt identical to an earlier one, and one extending an earlier output.
    assert _greedy_ids(on, prompts[:1]) == expected[:1]
    longer = prompts[0] + expected[0]
    assert _greedy_ids(on, [longer]) == _greedy_ids(off, [longer])
    on.reset_prefix_cache()
    assert _greedy_ids(on, prompts[:2]) == expected[:2]


def test_preemption_with_caching_keeps_greedy_outputs(tiny_models) -> None:
    path = str(tiny_models["llama"])
    rng = random.Random(1)
    shared = [rng.randrange(10, 200) for _ in range(20)]
    prompts = [shared + [rng.randrange(10, 200) for _ in range(5 + i)] for i in range(6)]
    alone = LLM(path, dtype="float32", max_model_len=64, enable_prefix_caching=False)
    expected = [_greedy_ids(alone, [p], max_tokens=24)[0] for p in prompts]
    tight = LLM(path, dtype="float32", max_model_len=64, num_gpu_blocks_override=8)
    assert _greedy_ids(tight, prompts, max_tokens=24) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    pool = tight.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_engine_stats_snapshot(tiny_models) -> None:
    path = str(tiny_models["llama"])
    llm = LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks_override=40)
    empty = llm.get_stats()
    assert empty.num_blocks == 40 and empty.num_used_blocks == 0 and empty.num_steps == 0
    assert empty.ttft.count == 0 and empty.spec_acceptance_rate == 0.0
    rng = random.Random(2)
    system = [rng.randrange(10, 200) for _ in range(48)]
    _greedy_ids(llm, [[*system, 11, 12]], max_tokens=5)
    outs = llm.generate(
        [{"prompt_token_ids": [*system, 13 + i]} for i in range(3)],
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    # Three 16-token blocks of the shared system prompt were reused by each later request.
    assert [o.num_cached_tokens for o in outs] == [48, 48, 48]
    assert all(o.metrics.num_cached_tokens == 48 for o in outs)
    stats = llm.get_stats(include_blocks=True)
    assert stats.num_used_blocks == 0 and stats.num_cached_free_blocks > 0
    assert stats.num_cached_free_blocks + stats.num_free_blocks == 40
    assert stats.prefix_hits == 3 * 48 and stats.prefix_queries == 50 + 3 * 49
    assert 0 < stats.prefix_hit_rate < 1 and stats.recent_prefix_hit_rate > 0
    assert stats.total_generation_tokens == 20
    assert stats.total_prompt_tokens == 50 + 3 * 1
    assert stats.generation_throughput > 0 and stats.prompt_throughput > 0
    assert stats.ttft.count == 4 and stats.ttft.p50 is not None
    assert stats.itl.count == 16 and stats.e2e.count == 4 and stats.num_finished_requests == 4
    assert stats.num_running == stats.num_waiting == 0
    assert len(stats.blocks) == 40
    assert sum(b.state == "cached" for b in stats.blocks) == stats.num_cached_free_blocks
