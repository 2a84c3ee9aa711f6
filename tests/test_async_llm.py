"""AsyncLLM: streaming from asyncio and threads, aborts, shutdown, and error delivery."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tinyvllm import LLM, EngineArgs, RequestOutput, RequestOutputKind, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestError
from tinyvllm.engine.engine import Engine, child_request_id

# One intra-op thread: see the fixture in conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIMEOUT = 60.0  # no test may hang: every wait is bounded by this
KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)


def greedy(max_tokens: int = 8, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def make_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tokens_of(outputs: list[RequestOutput], kind: RequestOutputKind) -> list[int]:
    """Reassemble a stream's token ids: deltas add up, cumulative outputs replace."""
    if kind == RequestOutputKind.DELTA:
        return [t for out in outputs for t in out.outputs[0].token_ids]
    return list(outputs[-1].outputs[0].token_ids) if outputs else []


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str | None = None):
    return [out async for out in llm.generate({"prompt_token_ids": prompt}, params, rid)]


async def collect_text(a: AsyncLLM, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in a.generate(prompt, params)]


def assert_engine_clean(engine: Engine) -> None:
    pool = engine.kv_cache_manager.pool
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(c == 0 for c in pool.ref_counts)


class Reference:
    """Greedy tokens of each prompt run alone (a batch of one) through the LLM."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._done: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        # Greedy output for fewer tokens is a prefix of the output for more.
        if len(self._done.get(key, ())) < max_tokens:
            out = self.llm.generate(
                {"prompt_token_ids": prompt}, greedy(max_tokens), use_tqdm=False
            )
            self._done[key] = out[0].outputs[0].token_ids
        return self._done[key][:max_tokens]


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> Reference:
    return Reference(llm)


@pytest.fixture
def start(llm: LLM) -> Iterator[Callable[[], AsyncLLM]]:
    """Start AsyncLLMs over the shared engine (compute references first: the LLM drives the
    same engine); each is shut down, and the engine checked clean, after the test."""
    started: list[AsyncLLM] = []

    def _start() -> AsyncLLM:
        started.append(AsyncLLM(llm.engine))
        return started[-1]

    yield _start
    for a in started:
        a.shutdown(timeout=TIMEOUT)
        assert not a.is_running
    assert_engine_clean(llm.engine)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_stream_matches_llm_generate(llm: LLM, start, kind: RequestOutputKind) -> None:
    prompts = ["def main():\n    x = 1\n", "import os\n"]
    expected = llm.generate(prompts, greedy(12), use_tqdm=False)
    a = start()

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect_text(a, p, greedy(12, kind)) for p in prompts))

    for outs, ref in zip(run(main()), expected, strict=True):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert tokens_of(outs, kind) == ref.outputs[0].token_ids
        if kind == RequestOutputKind.DELTA:
            assert "".join(o.outputs[0].text for o in outs) == ref.outputs[0].text
            assert len(outs) > 1
        else:
            assert outs[-1].outputs[0].text == ref.outputs[0].text
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        assert outs[-1].outputs[0].finish_reason == "length"


def test_sync_stream_matches_llm_generate(llm: LLM, reference: Reference, start) -> None:
    prompt = make_prompts(1, seed=3)[0]
    expected = reference(prompt, 10)
    a = start()
    for kind in KINDS:
        outs = list(a.stream({"prompt_token_ids": prompt}, greedy(10, kind), timeout=TIMEOUT))
        assert tokens_of(outs, kind) == expected and outs[-1].finished


def test_hundreds_of_concurrent_streams(reference: Reference, start) -> None:
    prompts = make_prompts(12, seed=10)  # seed chosen for no greedy near-ties (gap > 0.08)
    rng = random.Random(0)
    jobs = [(rng.choice(prompts), rng.randint(1, 8), rng.choice(KINDS)) for _ in range(200)]
    expected = [reference(p, n) for p, n, _ in jobs]
    a = start()

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(collect(a, p, greedy(n, kind), f"r{i}") for i, (p, n, kind) in enumerate(jobs))
        )

    results = run(main())
    for (_, _, kind), outs, ref in zip(jobs, results, expected, strict=True):
        assert tokens_of(outs, kind) == ref


def test_abort_by_id_ends_stream_and_frees_blocks(llm: LLM, start) -> None:
    a = start()
    pool = llm.engine.kv_cache_manager.pool

    async def main() -> list[RequestOutput]:
        outs = []
        params = greedy(200, RequestOutputKind.DELTA)
        async for out in a.generate({"prompt_token_ids": [11] * 40}, params, "victim"):
            outs.append(out)
            if len(outs) == 2:
                await a.abort("victim")  # resolves once the engine thread has aborted it
                assert pool.num_free_blocks == pool.num_blocks
                assert not llm.engine.has_unfinished_requests()
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(tokens_of(outs, RequestOutputKind.DELTA)) < 200


def test_cancelling_or_leaving_the_stream_aborts_at_once(llm: LLM, start) -> None:
    prompt = {"prompt_token_ids": make_prompts(1, seed=4)[0]}
    a = start()

    async def main() -> None:
        got_some = asyncio.Event()

        async def victim() -> None:
            async for _ in a.generate(prompt, greedy(200), "victim"):
                got_some.set()

        task = asyncio.create_task(victim())
        await got_some.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await a.abort("barrier")  # commands apply in order: the victim's abort has run
        assert_engine_clean(llm.engine)

        # Leaving an `async for` early aborts too (via the generator's aclose).
        gen = a.generate(prompt, greedy(200), "left")
        async for _ in gen:
            break
        await gen.aclose()
        await a.abort("barrier")
        assert_engine_clean(llm.engine)

        # Even without aclose: the dropped generator is closed by asyncio's finalizer hook.
        async for _ in a.generate(prompt, greedy(200), "dropped"):
            break
        await asyncio.sleep(0.05)  # the hook schedules aclose as a task on this loop
        await a.abort("barrier")
        assert_engine_clean(llm.engine)

    run(main())


def test_threads_add_abort_and_close(llm: LLM, reference: Reference, start) -> None:
    prompts = make_prompts(8, seed=5)
    expected = [reference(p, 6) for p in prompts]
    a = start()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i, (prompt, ref) in enumerate(zip(prompts, expected, strict=True)):
                params = greedy(6 if i % 3 == 0 else 200, RequestOutputKind.DELTA)
                rid = f"w{w}-{i}"
                stream = a.stream({"prompt_token_ids": prompt}, params, rid, timeout=TIMEOUT)
                if i % 3 == 0:
                    assert tokens_of(list(stream), RequestOutputKind.DELTA) == ref
                elif i % 3 == 1:
                    next(stream)
                    stream.close()  # walking away aborts
                else:
                    a.abort(rid)  # abort from this thread while the stream is live
                    outs = list(stream)
                    assert outs[-1].outputs[0].finish_reason == "abort"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    a.abort("barrier").result(TIMEOUT)
    assert_engine_clean(llm.engine)


def test_shutdown_with_drain_finishes_in_flight_requests(
    llm: LLM, reference: Reference, start
) -> None:
    prompts = make_prompts(3, seed=6)
    expected = [reference(p, 7) for p in prompts]
    a = start()
    streams = [a.stream({"prompt_token_ids": p}, greedy(7), timeout=TIMEOUT) for p in prompts]
    a.shutdown(drain=True, timeout=TIMEOUT)
    assert not a.is_running and not a.errored
    for stream, ref in zip(streams, expected, strict=True):
        assert tokens_of(list(stream), RequestOutputKind.CUMULATIVE) == ref
    with pytest.raises(RuntimeError, match="shut down"):
        a.stream({"prompt_token_ids": prompts[0]}, greedy())
    a.shutdown()  # idempotent


def test_shutdown_without_drain_and_context_managers(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [12] * 30}
    with AsyncLLM(llm.engine) as a:
        stream = a.stream(prompt, greedy(200), timeout=TIMEOUT)
        assert a.is_running
    outs = list(stream)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200
    assert_engine_clean(llm.engine)

    async def main() -> list[RequestOutput]:
        async with AsyncLLM(llm.engine) as b:
            outs: list[RequestOutput] = []
            started = asyncio.Event()

            async def consume() -> None:
                async for out in b.generate(prompt, greedy(200)):
                    outs.append(out)
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
        await task  # ends normally: the shutdown delivered an "abort" output
        assert not b.is_running
        return outs

    outs = run(main())
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert_engine_clean(llm.engine)


def test_failing_request_raises_request_error_others_finish(
    llm: LLM, reference: Reference, start, monkeypatch
) -> None:
    prompts = make_prompts(3, seed=7)
    expected = [reference(p, 10) for p in prompts]
    processor = llm.engine.output_processor
    on_tokens = processor.on_tokens

    def flaky(request_id: str, new_token_ids: list[int], *args: Any) -> str | None:
        child = processor.children[request_id]
        if request_id == child_request_id("boom", 0) and len(child.token_ids) >= 3:
            raise RuntimeError("detokenizer exploded")
        return on_tokens(request_id, new_token_ids, *args)

    monkeypatch.setattr(processor, "on_tokens", flaky)
    a = start()

    async def boom() -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        with pytest.raises(RequestError) as info:
            params = greedy(10, RequestOutputKind.DELTA)
            async for out in a.generate({"prompt_token_ids": prompts[0]}, params, "boom"):
                outs.append(out)
        assert info.value.request_id == "boom" and "detokenizer exploded" in info.value.message
        assert info.value.output is not None
        assert info.value.output.outputs[0].finish_reason == "error"
        return outs

    async def main() -> tuple[Any, ...]:
        return await asyncio.gather(
            boom(),
            collect(a, prompts[1], greedy(10)),
            collect(a, prompts[2], greedy(10)),
        )

    partial, good1, good2 = run(main())
    # The outputs before the failure were delivered, and they are correct.
    assert tokens_of(partial, RequestOutputKind.DELTA) == expected[0][:3]
    assert tokens_of(good1, RequestOutputKind.CUMULATIVE) == expected[1]
    assert tokens_of(good2, RequestOutputKind.CUMULATIVE) == expected[2]


def test_n_samples_stream_and_a_failing_sample(llm: LLM, start, monkeypatch) -> None:
    prompt = make_prompts(1, seed=9)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    expected = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    a = start()
    delta = params.clone()
    delta.output_kind = RequestOutputKind.DELTA
    outs = run(collect(a, prompt, delta))
    for sample in expected.outputs:
        got = [t for o in outs for c in o.outputs if c.index == sample.index for t in c.token_ids]
        assert got == sample.token_ids

    # One failing sample fails the whole request, and its sibling is aborted with it.
    processor = llm.engine.output_processor
    on_tokens = processor.on_tokens

    def flaky(request_id: str, *args: Any) -> str | None:
        if request_id == child_request_id("pair", 1):
            raise RuntimeError("sample 1 broke")
        return on_tokens(request_id, *args)

    monkeypatch.setattr(processor, "on_tokens", flaky)
    with pytest.raises(RequestError, match="sample 1 broke"):
        run(collect(a, prompt, params, "pair"))
    a.abort("barrier").result(TIMEOUT)
    assert "pair" not in llm.engine.parents


def test_engine_crash_reaches_every_stream(tiny_models, monkeypatch) -> None:
    # A private engine: the crash leaves requests stranded inside it.
    engine = LLM(str(tiny_models["qwen2"]), dtype="float32", max_model_len=128).engine
    a = AsyncLLM(engine)
    schedule = engine.scheduler.schedule
    calls = {"n": 0}

    def buggy() -> Any:
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyError("scheduler bug")
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", buggy)
    prompts = make_prompts(4, seed=8)
    sync_stream = a.stream({"prompt_token_ids": prompts[0]}, greedy(50), timeout=TIMEOUT)

    async def one(prompt: list[int]) -> None:
        with pytest.raises(EngineDeadError, match="scheduler bug") as info:
            await collect(a, prompt, greedy(50))
        assert isinstance(info.value.__cause__, KeyError)

    async def main() -> None:
        await asyncio.gather(*(one(p) for p in prompts[1:]))
        with pytest.raises(EngineDeadError):
            await collect(a, prompts[0], greedy())

    run(main())
    with pytest.raises(EngineDeadError):
        list(sync_stream)
    with pytest.raises(EngineDeadError):
        a.stream({"prompt_token_ids": prompts[0]}, greedy())
    assert a.errored and not a.is_running and isinstance(a.dead_error, EngineDeadError)
    a.abort("anything").result(TIMEOUT)  # a no-op, not a hang
    with pytest.raises(EngineDeadError):
        a.reset_prefix_cache().result(TIMEOUT)
    a.shutdown(timeout=TIMEOUT)


def test_bad_input_raises_at_submission(llm: LLM, start) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    a = start()
    with pytest.raises(ValueError, match="out-of-vocabulary"):
        a.stream({"prompt_token_ids": [10**6]}, greedy())
    with pytest.raises(ValueError, match="prompt is empty"):
        a.stream("", greedy())
    with pytest.raises(TypeError, match="SamplingParams"):
        a.stream("hello", {"max_tokens": 3})  # type: ignore[arg-type]

    async def main() -> None:
        with pytest.raises(ValueError, match="longer than max_model_len"):
            await collect(a, [5] * 300, greedy())
        # A duplicate id fails alone; the live request with that id is untouched.
        started = asyncio.Event()

        async def live() -> list[RequestOutput]:
            outs = []
            async for out in a.generate({"prompt_token_ids": [7] * 9}, greedy(200), "dup"):
                outs.append(out)
                started.set()
            return outs

        task = asyncio.create_task(live())
        await started.wait()
        with pytest.raises(ValueError, match="already in use"):
            await collect(a, [7] * 9, greedy(20), "dup")
        await a.abort("barrier")
        assert "dup" in llm.engine.parents
        await a.abort("dup")
        assert (await task)[-1].outputs[0].finish_reason == "abort"

    run(main())


def test_idle_loop_sleeps_and_passthroughs(llm: LLM, start, monkeypatch) -> None:
    a = start()
    assert a.get_tokenizer() is llm.get_tokenizer()
    list(a.stream("hello", greedy(2), timeout=TIMEOUT))
    time.sleep(0.2)  # let torch's worker threads stop spinning
    before = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - before < 0.1  # the engine thread blocks while idle
    monkeypatch.setattr(llm.engine, "get_stats", lambda **kw: ("stats", kw), raising=False)
    assert a.get_stats(include_blocks=True) == ("stats", {"include_blocks": True})
    assert a.reset_prefix_cache().result(TIMEOUT) is True
    with pytest.raises(TypeError, match="already-built Engine"):
        AsyncLLM(llm.engine, max_model_len=64)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks only")
def test_engine_thread_leaves_ctrl_c_to_the_main_thread(start) -> None:
    a = start()
    mask = a._call(lambda engine: signal.pthread_sigmask(signal.SIG_BLOCK, [])).result(TIMEOUT)
    assert signal.SIGINT in mask
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_constructors(tiny_models: dict[str, Path]) -> None:
    path = str(tiny_models["llama"])
    with AsyncLLM(path, dtype="float32", max_model_len=64) as a:
        assert a.engine.config.model.max_model_len == 64
        outs = list(a.stream({"prompt_token_ids": [9] * 5}, greedy(3), timeout=TIMEOUT))
        assert len(outs[-1].outputs[0].token_ids) == 3
    args = EngineArgs(model=path, dtype="float32", max_model_len=32)
    with AsyncLLM.from_engine_args(args) as b:
        assert b.engine_args is args and b.engine.config.model.max_model_len == 32
