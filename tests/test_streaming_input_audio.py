"""Streaming audio into a realtime model (tiny random Voxtral Realtime): chunks appended to a
running request through `AsyncLLM.generate` give the offline path's tokens; decode waits for
each position's audio without holding up other requests; bad audio fails only its request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_async_llm import TIMEOUT, assert_engine_clean, run
from test_streaming_input import collect, failure_beside, gather_on
from voxtral_realtime_fixtures import PROMPT, build_tiny_voxtral, random_audio

from tinyvllm import LLM, RequestOutput, SamplingParams, StreamingInput
from tinyvllm.engine.async_llm import AsyncLLM, RequestError
from tinyvllm.sampling_params import RequestOutputKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def vox_llm(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LLM:
    path = build_tiny_voxtral(tmp_path_factory.mktemp("voxtral_rt_stream"), tokenizer_dir)
    return LLM(str(path), dtype="float32", max_model_len=256)


@pytest.fixture
def vox(vox_llm: LLM) -> Iterator[AsyncLLM]:
    a = AsyncLLM(vox_llm.engine)
    yield a
    a.shutdown(timeout=TIMEOUT)
    assert_engine_clean(vox_llm.engine)
    assert not vox_llm.engine.input_streams.streams


def greedy(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def offline(llm: LLM, clip: np.ndarray) -> list[int]:
    prompt = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (clip, 16000)}}
    return llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids


async def audio_chunks(
    clip: np.ndarray, size: int, gate: asyncio.Event | None = None, delay: float = 0.0
) -> AsyncIterator[StreamingInput]:
    """The prompt with the first `size` samples, then the rest in chunks of `size` (int16
    PCM, as a microphone gives it); before the second chunk, wait for `gate`."""
    pcm = np.round(clip * 32767).astype(np.int16)
    first = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": pcm[:size]}}
    yield StreamingInput(first)
    if gate is not None:
        await gate.wait()
    for start in range(size, pcm.size, size):
        if delay:
            await asyncio.sleep(delay)
        yield StreamingInput({"multi_modal_data": {"audio": pcm[start : start + size]}})


def pcm_roundtrip(clip: np.ndarray) -> np.ndarray:
    return np.round(clip * 32767).astype(np.int16).astype(np.float32) / 32768.0


@pytest.mark.parametrize("size", [1280, 3000, 7777])
def test_streamed_audio_gives_the_offline_tokens(vox_llm: LLM, vox: AsyncLLM, size: int) -> None:
    clip = random_audio(1.23, seed=1)  # 123 mel frames: not a whole number of positions
    expected = offline(vox_llm, pcm_roundtrip(clip))
    outs = run(collect(vox.generate(audio_chunks(clip, size, delay=0.005), greedy(), "a")))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].outputs[0].token_ids == expected
    assert len(PROMPT) + len(expected) == -(-123 // 8)  # one token per audio position


def test_decode_waits_for_audio_and_others_run(vox_llm: LLM, vox: AsyncLLM) -> None:
    """A stream whose audio stops arriving computes the positions it has and waits; offline
    requests and another stream finish meanwhile; then the stalled one resumes."""
    clips = [random_audio(1.0, seed=s) for s in (2, 3, 4)]
    expected = [offline(vox_llm, pcm_roundtrip(c)) for c in clips]
    plain = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (clips[2], 16000)}}
    engine = vox_llm.engine

    async def main() -> list[list[RequestOutput]]:
        gate = asyncio.Event()
        stalled = asyncio.create_task(
            collect(vox.generate(audio_chunks(clips[0], 4000, gate), greedy(), "stalled"))
        )
        others = await asyncio.gather(
            collect(vox.generate(audio_chunks(clips[1], 2000, delay=0.005), greedy())),
            collect(vox.generate(plain, greedy())),
        )
        request = engine.scheduler.requests["stalled#0"]
        ready = request.input_limit
        assert ready is not None and request.num_computed_tokens == ready  # all it can
        assert request.num_tokens == ready + 1  # the token sampled from the last ready one
        gate.set()
        return [await stalled, *others]

    for outs, want in zip(run(main()), expected, strict=True):
        assert outs[-1].outputs[0].token_ids == want


def test_preempted_audio_streams_resume_from_the_received_audio(
    tiny_models, tokenizer_dir, tmp_path
) -> None:
    path = build_tiny_voxtral(tmp_path / "vox", tokenizer_dir)
    small = LLM(str(path), dtype="float32", max_model_len=64, num_gpu_blocks_override=5)
    clips = [random_audio(2.6, seed=10 + i) for i in range(3)]
    expected = [offline(small, pcm_roundtrip(c)) for c in clips]

    def job(a: AsyncLLM, clip: np.ndarray) -> Awaitable[list[RequestOutput]]:
        return collect(a.generate(audio_chunks(clip, 3000, delay=0.003), greedy()))

    results = gather_on(small, job, clips)
    assert small.engine.scheduler.num_preemptions > 0
    for outs, want in zip(results, expected, strict=True):
        assert outs[-1].outputs[0].token_ids == want
    assert_engine_clean(small.engine)


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (np.zeros((800, 2), dtype=np.float32), "audio must be mono"),
        ((np.zeros(800, dtype=np.float32), 8000), "streamed audio must be at 16000 Hz"),
        (np.zeros(800, dtype=np.int32), "float32 in [-1, 1] or int16 PCM"),
        ("tokens", "carry audio only"),
        ("image", "unsupported key(s) ['image']"),
    ],
)
def test_bad_audio_chunks_fail_only_their_request(
    vox_llm: LLM, vox: AsyncLLM, chunk: Any, message: str
) -> None:
    clip = random_audio(0.8, seed=5)
    expected = offline(vox_llm, pcm_roundtrip(clip))

    async def chunks() -> AsyncIterator[StreamingInput]:
        yield StreamingInput(
            {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": clip[:3000]}}
        )
        if isinstance(chunk, str) and chunk == "tokens":
            yield StreamingInput([5, 6])
        elif isinstance(chunk, str):
            yield StreamingInput({"multi_modal_data": {"image": clip}})
        else:
            yield StreamingInput({"multi_modal_data": {"audio": chunk}})

    good = vox.generate(audio_chunks(clip, 2500), greedy())
    error, outs = run(failure_beside(vox.generate(chunks(), greedy()), good))
    assert isinstance(error, RequestError) and message in str(error), error
    assert outs[-1].outputs[0].token_ids == expected


def test_empty_or_too_short_audio_is_one_clear_error(vox: AsyncLLM) -> None:
    async def only_prompt() -> AsyncIterator[StreamingInput]:
        yield StreamingInput({"prompt_token_ids": PROMPT})

    async def main() -> list[str]:
        errors = []
        for gen in (only_prompt(), audio_chunks(np.zeros(2000, dtype=np.float32), 1000)):
            with pytest.raises(RequestError) as info:
                await collect(vox.generate(gen, greedy()))
            errors.append(str(info.value))
        return errors

    for error in run(main()):
        assert "nothing to transcribe" in error


def test_engine_api_refuses_audio_after_end_of_input(vox_llm: LLM) -> None:
    engine = vox_llm.engine
    clip = random_audio(0.6, seed=6)
    first = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": clip[:4000]}}
    rid = engine.add_request("e", first, greedy(), streaming=True)
    engine.append_input(rid, {"multi_modal_data": {"audio": clip[4000:]}})
    engine.end_input(rid)
    with pytest.raises(ValueError, match="input chunk after its end of input"):
        engine.append_input(rid, {"multi_modal_data": {"audio": clip[:100]}})
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == offline(vox_llm, clip)
    assert_engine_clean(engine)


def test_audio_for_a_text_only_model_is_refused(tiny_models) -> None:
    """The first chunk's audio fails at submission; a later chunk's fails its request."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    a = AsyncLLM(llm.engine)

    async def chunks(first_audio: bool) -> AsyncIterator[StreamingInput]:
        audio = {"audio": np.zeros(1600, dtype=np.float32)}
        if first_audio:
            yield StreamingInput({"prompt_token_ids": [5, 6], "multi_modal_data": audio})
        else:
            yield StreamingInput([5, 6])
            yield StreamingInput({"multi_modal_data": audio})

    async def main() -> None:
        with pytest.raises(ValueError, match="cannot take audio"):
            await collect(a.generate(chunks(True), greedy(2)))
        with pytest.raises(RequestError, match="takes no streamed media"):
            await collect(a.generate(chunks(False), greedy(2)))

    try:
        run(main())
    finally:
        a.shutdown(timeout=TIMEOUT)
    assert_engine_clean(llm.engine)


def test_end_of_input_after_the_last_token_flushes_the_text(vox_llm: LLM) -> None:
    """A transcription that produced its last token before its input ended finishes at
    `end_input`: its text still ends as a full decode of its tokens does (an incomplete
    character flushed as U+FFFD), in final and in delta outputs."""
    engine = vox_llm.engine
    clip = random_audio(0.8, seed=5)  # its transcript ends inside a UTF-8 character
    prompt = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (clip, 16000)}}
    expected = vox_llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0]
    assert expected.text.endswith("\ufffd")
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
        params = SamplingParams(temperature=0.0, max_tokens=200, output_kind=kind)
        first = {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": clip}}
        rid = engine.add_request(f"flush-{kind.name}", first, params, streaming=True)
        request = engine.input_streams.streams[rid].request
        outs: list[RequestOutput] = []
        for _ in range(100):  # every position's token, then it waits for more audio
            before = request.num_output_tokens
            outs += engine.step()
            if request.num_output_tokens == before and request.num_output_tokens > 0:
                break
        ended = engine.end_input(rid)  # the last token is out: this ends the request
        assert ended and not engine.has_unfinished_requests()
        outs += ended
        assert outs[-1].finished
        text = "".join(o.outputs[0].text for o in outs)
        assert (text if kind == RequestOutputKind.DELTA else outs[-1].outputs[0].text) == (
            expected.text
        )
    assert_engine_clean(engine)
