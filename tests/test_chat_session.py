"""ChatSession over a tiny random model: the template and history, streaming, stop, settings,
trimming to the context, transcripts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.chat import ChatSession, TurnSummary
from tinyvllm.engine.async_llm import AsyncLLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 256


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["qwen2"]), dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture
def async_llm(llm: LLM) -> Iterator[AsyncLLM]:
    """An AsyncLLM over the shared engine (use the LLM only before this starts)."""
    a = AsyncLLM(llm.engine)
    yield a
    a.shutdown(timeout=30)


def turn(session: ChatSession, text: str) -> str:
    async def go() -> str:
        return "".join([d async for d in session.send(text)])

    return asyncio.run(go())


def test_multi_turn_matches_llm_chat(llm: LLM, tiny_models) -> None:
    # References first: LLM.chat drives the engine the AsyncLLM will own.
    first_ref = llm.chat([{"role": "user", "content": "hello there"}], greedy(), use_tqdm=False)
    first = first_ref[0].outputs[0].text
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "how are you"},
    ]
    second = llm.chat(conversation, greedy(), use_tqdm=False)[0].outputs[0].text

    a = AsyncLLM(llm.engine)
    try:
        session = ChatSession(a, greedy())
        assert turn(session, "hello there") == first
        summary = session.last_turn
        assert summary.finish_reason in ("stop", "length") and summary.completion_tokens > 0
        assert summary.prompt_tokens == len(first_ref[0].prompt_token_ids)
        # Same history as the reference conversation (with a fixed assistant turn).
        session.messages[-1]["content"] = "hi"
        session.system = "be brief"
        assert turn(session, "how are you") == second
        assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
        assert session.conversation()[0] == {"role": "system", "content": "be brief"}
        session.reset()
        assert session.messages == [] and session.last_turn is None
        assert session.system == "be brief"
    finally:
        a.shutdown(timeout=30)


def test_stop_keeps_partial_answer(async_llm: AsyncLLM) -> None:
    session = ChatSession(async_llm, greedy(max_tokens=200, ignore_eos=True))
    finished_before = async_llm.get_stats().num_finished_requests

    async def go() -> list[str]:
        deltas = []
        async for delta in session.send("tell me a long story"):
            deltas.append(delta)
            if len(deltas) == 3:
                # Like a Ctrl-C arriving late in a step: the engine has made more tokens by
                # then, and none of them may reach the user.
                time.sleep(0.2)
                session.stop()
        return deltas

    deltas = asyncio.run(go())
    assert len(deltas) == 3
    # A stopped request is a request: /stats counts it.
    assert async_llm.get_stats().num_finished_requests == finished_before + 1
    last = session.messages[-1]
    assert last == {"role": "assistant", "content": "".join(deltas), "stopped": True}
    assert session.last_turn.finish_reason == "abort" and "stopped" in session.last_turn.line()
    assert not session.busy
    # The stopped turn is part of the next prompt; stop() when idle is a no-op.
    session.stop()
    turn(session, "go on")
    assert len(session.messages) == 4 and "stopped" not in session.messages[-1]


def test_leaving_the_stream_counts_as_stopped(async_llm: AsyncLLM) -> None:
    session = ChatSession(async_llm, greedy(max_tokens=100, ignore_eos=True))

    async def go() -> None:
        stream = session.send("hi")
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(go())
    assert session.messages[-1]["stopped"] is True and not session.busy


def test_reset_during_an_answer_leaves_an_empty_history(async_llm: AsyncLLM) -> None:
    session = ChatSession(async_llm, greedy(max_tokens=100, ignore_eos=True))

    async def go() -> None:
        async for _ in session.send("hi"):
            session.reset()

    asyncio.run(go())
    assert session.messages == [] and session.last_turn is None and not session.busy


def test_set_param_parsing_and_errors(async_llm: AsyncLLM) -> None:
    session = ChatSession(async_llm)
    session.set_param("top_p", "0.5")
    session.set_param("temperature=0")  # greedy must not wipe the user's top_p
    session.set_param("temperature", 0.8)
    assert session.params.top_p == 0.5 and session.params.temperature == 0.8
    session.set_param("max-tokens=none")
    session.set_param("seed", "7")
    assert session.params.max_tokens is None and session.params.seed == 7
    with pytest.raises(ValueError, match="unknown setting 'colour'; valid settings: temperature"):
        session.set_param("colour=red")
    with pytest.raises(ValueError, match="top_k must be an integer, got 'lots'"):
        session.set_param("top_k", "lots")
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 2.0"):
        session.set_param("top_p=2")
    assert session.params.top_p == 0.5  # a rejected value changes nothing


def test_history_is_trimmed_to_the_context(async_llm: AsyncLLM) -> None:
    notices: list[str] = []
    session = ChatSession(
        async_llm, greedy(max_tokens=16), system="sys prompt", notice=notices.append
    )
    words = " ".join(["lorem"] * 40)
    for _ in range(8):
        turn(session, words)
    assert notices and "dropped" in notices[0] and f"{MAX_LEN}-token" in notices[0]
    assert session.last_turn.dropped_turns >= 1 or any("dropped" in n for n in notices)
    assert session.system == "sys prompt"
    assert session.messages[0]["role"] == "user" and session.messages[-1]["role"] == "assistant"
    before = list(session.messages)
    with pytest.raises(ValueError, match="send a shorter message"):
        turn(session, " ".join(["lorem"] * 400))
    assert session.messages == before


def test_save_json_and_markdown(async_llm: AsyncLLM, tmp_path: Path) -> None:
    session = ChatSession(async_llm, greedy(), system="sys")
    session.messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "stopped": True},
    ]
    data = json.loads(session.save(tmp_path / "t.json").read_text())
    assert data["system"] == "sys" and data["messages"] == session.messages
    assert data["params"]["temperature"] == 0.0
    md = session.save(tmp_path / "t.md").read_text()
    assert "**user:**\n\nq" in md and "**assistant:** *(stopped)*" in md


def test_turn_summary_line() -> None:
    line = TurnSummary(12, 34, 25.25, 0.412, "length", dropped_turns=2).line()
    assert line == (
        "[34 tokens, 25.2 tok/s, TTFT 0.41 s, prompt 12 tokens, hit the token limit, "
        "2 old turn(s) dropped]"
    )
    assert TurnSummary(1, 1, 0.0, None, "stop").line() == "[1 tokens, 0.0 tok/s, prompt 1 tokens]"


def test_save_never_overwrites_unless_asked_and_never_follows_symlinks(
    async_llm: AsyncLLM, tmp_path: Path
) -> None:
    session = ChatSession(async_llm, greedy())
    session.messages = [{"role": "user", "content": "q"}]
    target = tmp_path / "t.json"
    target.write_text("precious")
    with pytest.raises(FileExistsError):
        session.save(target)
    assert target.read_text() == "precious"
    session.save(target, overwrite=True)
    assert json.loads(target.read_text())["messages"] == session.messages

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "link.md"
    link.symlink_to(victim)
    for overwrite in (False, True):
        with pytest.raises(OSError):
            session.save(link, overwrite=overwrite)
    dangling = tmp_path / "dangling.md"
    dangling.symlink_to(tmp_path / "created-through-link.md")
    with pytest.raises(OSError):
        session.save(dangling)
    assert victim.read_text() == "precious"
    assert not (tmp_path / "created-through-link.md").exists()


# b"caf\xe9" read with errors="surrogateescape"; tokenizers raise a bare TypeError on it.
UNENCODABLE = "caf\udce9 au lait"


def test_lone_surrogates_in_llm_generate_are_a_clear_value_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 1: the prompt is not valid Unicode.*'\\udce9'"):
        llm.generate(["fine", UNENCODABLE], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="the chat is not valid Unicode"):
        llm.chat([{"role": "user", "content": UNENCODABLE}], greedy(), use_tqdm=False)


def test_lone_surrogates_in_a_stream_or_chat_are_a_clear_value_error(
    async_llm: AsyncLLM,
) -> None:
    bad = UNENCODABLE

    async def stream(prompt: str) -> None:
        async for _ in async_llm.generate(prompt, greedy()):
            pass

    with pytest.raises(ValueError, match="lone surrogate"):
        asyncio.run(stream(bad))
    session = ChatSession(async_llm, greedy())
    with pytest.raises(ValueError, match="the message is not valid Unicode"):
        turn(session, bad)
    assert session.messages == []
    with pytest.raises(ValueError, match="the system prompt is not valid Unicode"):
        session.system = bad
    assert turn(session, "still works") is not None and len(session.messages) == 2


def test_default_sampling_comes_from_the_checkpoint_else_the_fallback(
    async_llm: AsyncLLM, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    from tinyvllm.chat.defaults import (
        DEFAULT_MAX_TOKENS,
        FALLBACK_TEMPERATURE,
        default_chat_params,
        model_sampling_defaults,
    )

    def checkpoint(name: str, generation_config: str | None) -> Any:
        path = tmp_path / name
        path.mkdir()
        if generation_config is not None:
            (path / "generation_config.json").write_text(generation_config)
        model = SimpleNamespace(model_path=str(path))
        return SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(model=model)))

    llama = checkpoint(
        "llama",
        '{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2}',
    )
    assert model_sampling_defaults(llama.engine.config.model.model_path) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
    }
    params = default_chat_params(llama, top_k=None, max_tokens=50)  # a flag given, one not
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        0.6,
        0.9,
        20,
        50,
    )
    for name, text in [("ids_only", '{"eos_token_id": 2}'), ("broken", "{"), ("none", None)]:
        params = default_chat_params(checkpoint(name, text))
        assert (params.temperature, params.top_p) == (FALLBACK_TEMPERATURE, 1.0)
    # A value SamplingParams rejects is ignored, not fatal.
    odd = default_chat_params(checkpoint("odd", '{"temperature": 0.5, "top_p": 7}'))
    assert (odd.temperature, odd.top_p) == (FALLBACK_TEMPERATURE, 1.0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_sampling_defaults(gguf) == {}
    # The tiny checkpoint's generation_config has token ids only.
    session = ChatSession(async_llm)
    assert session.params.temperature == FALLBACK_TEMPERATURE
    assert session.params.max_tokens == DEFAULT_MAX_TOKENS
