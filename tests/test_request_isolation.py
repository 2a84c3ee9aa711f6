"""One request's failure stays its own: values the model runner cannot store, non-finite
logits, and request ids that look like another request's internal ids must never fail, stall
or spin the rest of the engine."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest

from tinyvllm import LLM, RequestOutputKind, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM, RequestError
from tinyvllm.engine.engine import Engine, child_request_id

# One intra-op thread: see the fixture in conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIMEOUT = 60.0


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def generate(llm: LLM, batch: list[list[int]], params: Any) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def assert_engine_clean(engine: Engine) -> None:
    pool = engine.kv_cache_manager.pool
    assert not engine.parents and not engine.scheduler.has_unfinished_requests()
    assert not engine.output_processor.children and not engine._child_to_parent
    assert pool.num_free_blocks == pool.num_blocks


def run_until_done(engine: Engine, max_steps: int = 500) -> dict[str, Any]:
    results = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            results[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {engine.parents}")


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)


# ---- values the runner cannot store ---------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 1e39), ("repetition_penalty", 1e39), ("top_k", 2**63)],
)
def test_unstorable_value_fails_only_its_request(llm: LLM, caplog, field: str, value) -> None:
    good0, bad_prompt, good1 = prompts(3, seed=1)
    expected = [o.outputs[0].token_ids for o in generate(llm, [good0, good1], greedy())]
    bad = SamplingParams(temperature=1.0, max_tokens=8)
    setattr(bad, field, value)  # past validation, as a caller mutating its params could
    with caplog.at_level(logging.WARNING, logger="tinyvllm.llm"):
        outs = generate(llm, [good0, bad_prompt, good1], [greedy(), bad, greedy()])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    assert [outs[0].outputs[0].finish_reason, outs[2].outputs[0].finish_reason] == ["length"] * 2
    assert outs[1].outputs[0].finish_reason == "error"
    assert "cannot be stored" in outs[1].error
    # LLM.generate says so: its outputs (shaped like vLLM's) would not show it otherwise.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("prompt 1" in w and "cannot be stored" in w for w in warnings), warnings
    assert_engine_clean(llm.engine)


def test_stop_ids_past_the_vocabulary_are_harmless_with_min_tokens(llm: LLM) -> None:
    vocab = llm.engine.config.model.vocab_size
    (prompt,) = prompts(1, seed=2)
    expected = generate(llm, [prompt], greedy())[0].outputs[0].token_ids
    params = greedy()
    params.stop_token_ids = [vocab + 5, 2**70]
    params.min_tokens = 2
    out = generate(llm, [prompt], params)[0]
    assert out.outputs[0].token_ids == expected and out.error is None


def test_bad_request_does_not_end_running_streams(llm: LLM) -> None:
    long_prompt, bad_prompt = prompts(2, seed=3)
    expected = generate(llm, [long_prompt], greedy(40))[0].outputs[0].token_ids
    a = AsyncLLM(llm.engine)
    try:
        stream = a.stream({"prompt_token_ids": long_prompt}, greedy(40), timeout=TIMEOUT)
        first = next(stream)
        bad = SamplingParams(temperature=1.0, max_tokens=4)
        bad.temperature = 1e39
        with pytest.raises(RequestError, match="cannot be stored"):
            list(a.stream({"prompt_token_ids": bad_prompt}, bad, timeout=TIMEOUT))
        outs = [first, *stream]
        assert outs[-1].outputs[0].token_ids == expected
        assert outs[-1].outputs[0].finish_reason == "length"
    finally:
        a.shutdown(timeout=TIMEOUT)
    assert_engine_clean(llm.engine)


# ---- non-finite logits ----------------------------------------------------------------------
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "verify"])
def test_non_finite_logits_fail_the_request_not_the_batch(tiny_models, speculative) -> None:
    import torch
    from test_spec_decode import NGRAM, OracleProposer, _always_speculate

    kwargs: dict[str, Any] = {"speculative_config": NGRAM} if speculative else {}
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128, **kwargs)
    victim, good0, good1 = prompts(3, seed=4)
    batch = [good0, victim, good1]
    expected = [o.outputs[0].token_ids for o in generate(llm, batch, greedy())]
    if speculative:  # every step verifies drafts (mostly right ones)
        _always_speculate(llm)
        llm.engine.runner.speculator.proposer = OracleProposer(
            [p + e for p, e in zip(batch, expected, strict=True)]
        )
    # NaN in the embedding of a token only the victim reads (its 4th output, or a draft of
    # it): from then on the victim's logits are NaN, and nobody else's.
    seen = {t for i, seq in enumerate([*batch, *expected]) if i not in (1, 4) for t in seq}
    poison = next(t for t in expected[1][3:] if t not in seen and t not in victim)
    embedding = next(p for name, p in llm.engine.runner.model.named_parameters() if "embed" in name)
    with torch.no_grad():
        embedding[poison] = float("nan")
    outs = generate(llm, batch, greedy())
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected[::2]
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error"
    cut = expected[1].index(poison)
    assert failed.token_ids == expected[1][: len(failed.token_ids)]
    assert len(failed.token_ids) <= cut + 1
    assert "not finite" in outs[1].error and "NaN" in outs[1].error
    assert_engine_clean(llm.engine)


# ---- request ids ----------------------------------------------------------------------------
def test_request_ids_cannot_collide_with_internal_ids(llm: LLM) -> None:
    engine = llm.engine
    prompt, other = prompts(2, seed=5)
    pair = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    pair.output_kind = RequestOutputKind.FINAL_ONLY
    single = greedy(5)
    single.output_kind = RequestOutputKind.FINAL_ONLY
    engine.add_request("foo", {"prompt_token_ids": prompt}, pair)
    lookalikes = ["0_foo", "1_foo", child_request_id("foo", 0), child_request_id("foo", 1)]
    for rid in lookalikes:
        engine.add_request(rid, {"prompt_token_ids": other}, single)
    with pytest.raises(ValueError, match="'foo' is already in use"):
        engine.add_request("foo", {"prompt_token_ids": other}, single)
    results = run_until_done(engine)
    assert sorted(results) == sorted(["foo", *lookalikes])
    assert [c.finish_reason for c in results["foo"].outputs] == ["length", "length"]
    assert all(len(c.token_ids) == 6 for c in results["foo"].outputs)
    expected = generate(llm, [other], greedy(5))[0].outputs[0].token_ids
    for rid in lookalikes:
        assert results[rid].outputs[0].token_ids == expected, rid
    assert_engine_clean(engine)


def test_failed_add_leaves_no_trace(llm: LLM, monkeypatch) -> None:
    engine = llm.engine
    (prompt,) = prompts(1, seed=6)
    add = engine.scheduler.add_request

    def second_child_fails(request: Any) -> None:
        if request.request_id == child_request_id("x", 1):
            raise RuntimeError("scheduler refused")
        add(request)

    monkeypatch.setattr(engine.scheduler, "add_request", second_child_fails)
    pair = SamplingParams(n=2, temperature=1.0, max_tokens=4)
    with pytest.raises(RuntimeError, match="scheduler refused"):
        engine.add_request("x", {"prompt_token_ids": prompt}, pair)
    engine.step()  # the runner drops what the aborted child left behind
    assert_engine_clean(engine)
    monkeypatch.undo()
    out = generate(llm, [prompt], greedy(3))[0]
    assert out.outputs[0].finish_reason == "length"


def test_engine_thread_waits_when_nothing_is_schedulable(llm: LLM, monkeypatch) -> None:
    engine = llm.engine
    (prompt,) = prompts(1, seed=7)
    expected = generate(llm, [prompt], greedy(4))[0].outputs[0].token_ids
    steps = 0
    step = engine.step

    def counted() -> list:
        nonlocal steps
        steps += 1
        return step()

    monkeypatch.setattr(engine, "step", counted)
    a = AsyncLLM(engine)
    try:
        # A token budget of 0 leaves a queued request unschedulable until something changes.
        monkeypatch.setattr(engine.scheduler.config, "max_num_batched_tokens", 0)
        stream = a.stream({"prompt_token_ids": prompt}, greedy(4), timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while steps == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        before = steps
        time.sleep(0.5)
        assert steps - before <= 1  # the engine thread blocks on its queue instead of spinning
        monkeypatch.undo()
        a.abort("nobody").result(TIMEOUT)  # any command wakes it up to look again
        assert list(stream)[-1].outputs[0].token_ids == expected
    finally:
        a.shutdown(timeout=TIMEOUT)
    assert_engine_clean(engine)


def test_generate_raises_instead_of_spinning_when_nothing_is_schedulable(
    llm: LLM, monkeypatch
) -> None:
    (prompt,) = prompts(1, seed=8)
    monkeypatch.setattr(llm.engine.scheduler.config, "max_num_batched_tokens", 0)
    with pytest.raises(RuntimeError, match="1 request\\(s\\) cannot be scheduled"):
        generate(llm, [prompt], greedy(4))
    monkeypatch.undo()
    llm.engine.step()  # the runner drops what the aborted request left behind
    assert_engine_clean(llm.engine)
    assert generate(llm, [prompt], greedy(4))[0].outputs[0].finish_reason == "length"
