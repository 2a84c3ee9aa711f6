"""Streaming-input requests: `AsyncLLM.generate` over an async iterator of StreamingInput.

The request's prompt grows while it runs; the scheduler computes only what has arrived, parks
the request without holding up others, and resumes it when more comes. Checked on the tiny
random Llama against the same prompt given whole.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import test_async_llm
from test_async_llm import TIMEOUT, assert_engine_clean, greedy, run

from tinyvllm import LLM, RequestOutput, RequestOutputKind, SamplingParams, StreamingInput
from tinyvllm.engine.async_llm import AsyncLLM, RequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# AsyncLLMs over this module's `llm`, shut down and checked clean after each test.
start = test_async_llm.start


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def split(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        out.append(tokens[i : i + size])
        i += size
    assert i == len(tokens)
    return out


async def feed(
    chunks: list[Any], gate: asyncio.Event | None = None, delay: float = 0.0
) -> AsyncIterator[StreamingInput]:
    """Yield the chunks; before the second one, wait for `gate` (a stalled stream)."""
    for i, chunk in enumerate(chunks):
        if i == 1 and gate is not None:
            await gate.wait()
        if i and delay:
            await asyncio.sleep(delay)
        yield StreamingInput(prompt=chunk)


async def collect(gen: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in gen]


async def failure_beside(
    bad: AsyncIterator[RequestOutput], good: AsyncIterator[RequestOutput]
) -> tuple[RequestError | None, list[RequestOutput]]:
    """Run a request that should fail beside one that should not: (the first's RequestError,
    None if it did not fail; the second's outputs)."""
    failing = asyncio.create_task(collect(bad))
    outputs = await collect(good)
    try:
        await failing
    except RequestError as exc:
        return exc, outputs
    return None, outputs


def gather_on(
    llm: LLM, job: Callable[[AsyncLLM, Any], Awaitable[list[RequestOutput]]], items: list[Any]
) -> list[list[RequestOutput]]:
    """`job(a, item)` for every item at once, on a fresh AsyncLLM over `llm`'s engine."""
    a = AsyncLLM(llm.engine)

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(job(a, item) for item in items))

    try:
        return run(main())
    finally:
        a.shutdown(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256)


def reference(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "sizes", [[1, 1, 1, 37], [17, 16, 7], [5, 11, 16, 1, 7]], ids=["tiny", "blocks", "mixed"]
)
def test_streamed_chunks_give_the_whole_prompts_tokens(llm: LLM, start, sizes) -> None:
    prompt = random_prompt(1, sum(sizes))
    expected = reference(llm, prompt, 10)
    a = start()

    async def main() -> list[RequestOutput]:
        # A pause between chunks: the engine computes what has arrived in between.
        chunks = feed(split(prompt, sizes), delay=0.02)
        return await collect(a.generate(chunks, greedy(10, RequestOutputKind.DELTA), "s"))

    outs = run(main())
    assert [t for o in outs for t in o.outputs[0].token_ids] == expected
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].prompt_token_ids == prompt


def test_text_chunks_are_tokenized_without_a_second_bos(llm: LLM, start) -> None:
    tok = llm.get_tokenizer()
    parts = ["def main():\n", "    x = 1\n", "    return x\n"]
    ids = tok.encode(parts[0]) + [
        t for p in parts[1:] for t in tok.encode(p, add_special_tokens=False)
    ]
    whole = llm.generate({"prompt_token_ids": ids}, greedy(8), use_tqdm=False)[0].outputs[0]
    a = start()
    outs = run(collect(a.generate(feed(parts), greedy(8))))
    assert outs[-1].outputs[0].token_ids == whole.token_ids
    assert outs[-1].outputs[0].text == whole.text
    assert outs[-1].prompt == "".join(parts)
    assert outs[-1].prompt_token_ids == ids


def test_first_chunks_sampling_params_replace_generates(llm: LLM, start) -> None:
    prompt = random_prompt(2, 12)
    expected = reference(llm, prompt, 3)
    a = start()

    async def chunks() -> AsyncIterator[StreamingInput]:
        yield StreamingInput(prompt[:5], sampling_params=greedy(3))
        yield StreamingInput(prompt[5:])

    outs = run(collect(a.generate(chunks(), greedy(9))))
    assert outs[-1].outputs[0].token_ids == expected


def test_two_streams_interleaved_with_ordinary_requests(llm: LLM, start) -> None:
    streams = [random_prompt(10 + i, 30 + 7 * i) for i in range(2)]
    plain = [random_prompt(20 + i, 5 + 9 * i) for i in range(4)]
    expected = [reference(llm, p, 12) for p in streams + plain]
    a = start()

    async def main() -> list[list[RequestOutput]]:
        jobs = [
            collect(a.generate(feed(split(p, [3, 9, len(p) - 12]), delay=0.01), greedy(12)))
            for p in streams
        ]
        jobs += [collect(a.generate({"prompt_token_ids": p}, greedy(12))) for p in plain]
        return await asyncio.gather(*jobs)

    for outs, ref in zip(run(main()), expected, strict=True):
        assert outs[-1].outputs[0].token_ids == ref


def test_a_stalled_stream_parks_without_blocking_others(llm: LLM, start, monkeypatch) -> None:
    prompt = random_prompt(3, 40)
    other = random_prompt(4, 9)
    expected, expected_other = reference(llm, prompt, 6), reference(llm, other, 20)
    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or step())
    a = start()

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        gate = asyncio.Event()
        stream = asyncio.create_task(
            collect(a.generate(feed(split(prompt, [20, 20]), gate), greedy(6), "stalled"))
        )
        # The stream's first chunk is computed, then it waits; another request runs to its end.
        others = await collect(a.generate({"prompt_token_ids": other}, greedy(20)))
        await asyncio.sleep(0.2)
        request = llm.engine.scheduler.requests["stalled#0"]
        assert request.num_computed_tokens == 19  # the last arrived token is held back
        assert request.awaiting_prompt and not request.output_token_ids
        idle_steps = len(steps)
        await asyncio.sleep(0.3)
        assert len(steps) - idle_steps <= 1  # parked: the loop sleeps instead of spinning
        gate.set()
        return await stream, others

    outs, others = run(main())
    assert others[-1].outputs[0].token_ids == expected_other
    assert outs[-1].outputs[0].token_ids == expected


def test_parked_waiting_stream_does_not_hold_up_the_queue(llm: LLM, start) -> None:
    """A stream whose only token so far is held back has nothing to compute, so it is passed
    over in the waiting queue while requests behind it are admitted."""
    other = random_prompt(5, 7)
    expected, expected_other = reference(llm, [42, 43, 44], 4), reference(llm, other, 4)
    a = start()

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        gate = asyncio.Event()
        stream = asyncio.create_task(collect(a.generate(feed([[42], [43, 44]], gate), greedy(4))))
        await asyncio.sleep(0.05)
        others = await collect(a.generate({"prompt_token_ids": other}, greedy(4)))
        gate.set()
        return await stream, others

    outs, others = run(main())
    assert others[-1].outputs[0].token_ids == expected_other
    assert outs[-1].outputs[0].token_ids == expected


def test_abort_and_cancel_end_a_stalled_stream(llm: LLM, start) -> None:
    a = start()
    closed = []

    async def chunks(gate: asyncio.Event) -> AsyncIterator[StreamingInput]:
        try:
            yield StreamingInput(random_prompt(6, 30))
            await gate.wait()
            yield StreamingInput([7])
        finally:
            closed.append(True)

    async def main() -> list[RequestOutput]:
        gate = asyncio.Event()
        task = asyncio.create_task(collect(a.generate(chunks(gate), greedy(5), "by-id")))
        await asyncio.sleep(0.1)
        await a.abort("by-id")
        outs = await task

        task = asyncio.create_task(collect(a.generate(chunks(gate), greedy(5), "cancelled")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await a.abort("barrier")  # commands apply in order: the cancel's abort has run
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert closed == [True, True]  # both input iterators were closed
    assert_engine_clean(a.engine)


def test_a_cancelled_input_iterator_aborts_its_request(llm: LLM, start) -> None:
    """The producer behind the iterator is cancelled (its CancelledError comes out of the
    iterator): the request ends with finish_reason "abort" instead of waiting forever."""
    a = start()

    async def main() -> list[RequestOutput]:
        async def chunks() -> AsyncIterator[StreamingInput]:
            yield StreamingInput(random_prompt(13, 20))
            await asyncio.sleep(0.05)
            raise asyncio.CancelledError

        return await collect(a.generate(chunks(), greedy(5), "cancelled-input"))

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert_engine_clean(a.engine)
    assert not a.engine.input_streams.streams


def test_preempted_streams_recompute_from_the_received_input(tiny_models) -> None:
    small = LLM(
        str(tiny_models["llama"]), dtype="float32", max_model_len=128, num_gpu_blocks_override=12
    )
    prompts = [random_prompt(30 + i, 40) for i in range(4)]
    expected = [reference(small, p, 24) for p in prompts]

    def job(a: AsyncLLM, p: list[int]) -> Awaitable[list[RequestOutput]]:
        return collect(a.generate(feed(split(p, [8, 8, 24]), delay=0.01), greedy(24)))

    results = gather_on(small, job, prompts)
    assert small.engine.scheduler.num_preemptions > 0
    for outs, ref in zip(results, expected, strict=True):
        assert outs[-1].outputs[0].token_ids == ref
    assert_engine_clean(small.engine)


def test_prefix_cache_hits_on_the_received_prefix(llm: LLM, start) -> None:
    shared = random_prompt(7, 48)
    first, second = shared + random_prompt(8, 5), shared + random_prompt(9, 6)
    expected = [reference(llm, first, 6), reference(llm, second, 6)]
    llm.engine.reset_prefix_cache()
    a = start()

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        one = await collect(a.generate(feed(split(first, [20, 33]), delay=0.01), greedy(6)))
        # The stream's blocks were cached as it computed them; this stream reads them.
        two = await collect(a.generate(feed(split(second, [40, 14]), delay=0.01), greedy(6)))
        return one, two

    one, two = run(main())
    assert [one[-1].outputs[0].token_ids, two[-1].outputs[0].token_ids] == expected
    assert two[-1].num_cached_tokens == 32  # the first chunk's two full blocks


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ([10**6], "out-of-vocabulary"),
        ({"multi_modal_data": {"audio": [0.0] * 160}}, "takes no streamed media (audio)"),
        ({"bogus": 1}, "needs 'prompt', 'prompt_token_ids'"),
        ("bad-type", "must yield StreamingInput"),
        ("late-params", "sampling_params can be set on the first StreamingInput only"),
        ("raises", "the input stream raised OSError: mic unplugged"),
        ([5] * 300, "more than max_model_len=256"),
    ],
)
def test_a_bad_chunk_fails_only_its_request(llm: LLM, start, second, message) -> None:
    other = random_prompt(11, 20)
    expected = reference(llm, other, 8)
    a = start()

    async def chunks() -> AsyncIterator[Any]:
        yield StreamingInput([12, 13, 14])
        if second == "bad-type":
            yield [15]
        elif second == "late-params":
            yield StreamingInput([15], sampling_params=greedy(2))
        elif second == "raises":
            raise OSError("mic unplugged")
        else:
            yield StreamingInput(second)

    bad = a.generate(chunks(), greedy(4))
    error, others = run(failure_beside(bad, a.generate({"prompt_token_ids": other}, greedy(8))))
    assert isinstance(error, RequestError) and message in str(error), error
    assert error.output is not None and error.output.outputs[0].finish_reason == "error"
    assert others[-1].outputs[0].token_ids == expected


def test_bad_streams_at_submission(llm: LLM, start) -> None:
    a = start()

    async def empty() -> AsyncIterator[StreamingInput]:
        return
        yield  # pragma: no cover

    async def main() -> None:
        with pytest.raises(ValueError, match="ended before its first StreamingInput"):
            await collect(a.generate(empty(), greedy()))
        with pytest.raises(ValueError, match="takes n=1"):
            params = SamplingParams(n=2, max_tokens=2)
            await collect(a.generate(feed([[1, 2]]), params))
        with pytest.raises(ValueError, match="the prompt is empty"):
            await collect(a.generate(feed([[]]), greedy()))
        closed = []

        async def not_chunks() -> AsyncIterator[Any]:
            try:
                yield [1, 2]
            finally:
                closed.append(True)

        with pytest.raises(ValueError, match="must yield StreamingInput chunks"):
            await collect(a.generate(not_chunks(), greedy()))
        assert closed == [True]

    run(main())


def test_engine_api_refuses_a_chunk_after_end_of_input(llm: LLM) -> None:
    engine = llm.engine
    expected = reference(llm, [20, 21, 22, 23], 3)
    rid = engine.add_request("e", {"prompt_token_ids": [20, 21]}, greedy(3), streaming=True)
    engine.append_input(rid, [22, 23])
    engine.end_input(rid)
    with pytest.raises(ValueError, match="input chunk after its end of input"):
        engine.append_input(rid, [24])
    with pytest.raises(ValueError, match="second end of input"):
        engine.end_input(rid)
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="not a streaming-input request in flight"):
        engine.append_input(rid, [25])
    assert_engine_clean(engine)


def test_a_hybrid_model_streams_too(tokenizer_dir, tmp_path) -> None:
    """LFM2 (recurrent conv state per request, prefix-cache snapshots on block boundaries):
    chunks that arrive while the prompt is computed give the whole prompt's tokens."""
    from lfm2_checkpoint import build_tiny_lfm2

    path = build_tiny_lfm2(tmp_path / "lfm2", tokenizer_dir)
    hybrid = LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=24)
    prompt = random_prompt(12, 70)
    expected = reference(hybrid, prompt, 8)
    hybrid.engine.reset_prefix_cache()

    def job(a: AsyncLLM, p: list[int]) -> Awaitable[list[RequestOutput]]:
        return collect(a.generate(feed(split(p, [9, 30, 31]), delay=0.02), greedy(8)))

    [outs] = gather_on(hybrid, job, [prompt])
    assert outs[-1].outputs[0].token_ids == expected
    assert_engine_clean(hybrid.engine)
