"""A step's bookkeeping around the model (Platform.start_step / finish_step, called by
ModelRunner.execute_model): torch's thread count inside each step follows that step's choice
and is restored after it, also when the step raises; inference mode is held by LLM.generate
across its steps and entered by the runner only for callers that do not hold it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import unsupported_reason
from tinyvllm.native.decode_route import DecodeRoute

native_only = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _record_steps(llm: LLM) -> list[tuple[int, int, bool]]:
    """(tokens, torch threads, on the program) of each step the runner runs from now on."""
    runner = llm.engine.runner
    seen: list[tuple[int, int, bool]] = []
    inner = runner._execute_model

    def recording(sched: Any) -> Any:
        tokens = sched.total_num_scheduled_tokens
        seen.append((tokens, torch.get_num_threads(), runner._program_step))
        return inner(sched)

    runner._execute_model = recording
    return seen


@native_only
def test_torch_threads_in_each_step_follow_its_choice(tiny_models, two_torch_threads) -> None:
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    platform = llm.engine.runner.platform
    assert platform.torch_threads.threads == 2
    program_rows = llm.engine.runner.decode_program.max_rows
    # Torch steps (prompts longer than the program takes, up to LONG_STEP_TOKENS: measured
    # both ways) follow their own choice, which changes from step to step.
    choices = iter([1, 2, 1, 2])
    platform.torch_threads.choose = lambda tokens: next(choices)
    seen = _record_steps(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for length in (40, 41, 42, 43):
        prompt = [(length + i) % 100 + 1 for i in range(length)]  # no shared prefix
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        assert torch.get_num_threads() == 2  # restored between requests
    assert all(tokens > program_rows for tokens, _, program in seen if not program)
    prompts = [(tokens, threads) for tokens, threads, program in seen if not program]
    assert prompts == [(40, 1), (41, 2), (42, 1), (43, 2)]
    decodes = {threads for tokens, threads, program in seen if program}
    # Decode steps run on the program's own threads: torch's stay at one there.
    assert decodes == {1} and len(seen) == 4 * 3


@native_only
def test_a_step_that_raises_leaves_threads_route_and_linears_as_before(
    two_torch_threads,
) -> None:
    from tinyvllm.platforms.cpu import CpuPlatform

    native = NativeCpuOps.load(2)
    assert native is not None
    platform = CpuPlatform(torch.device("cpu"), torch.bfloat16, native)
    route = platform.decode_route = DecodeRoute()
    route.choice.pick = lambda tokens: True  # this step goes to the layers
    platform.torch_threads.choose = lambda tokens: 1
    assert not platform.routes_to_program(16)
    with pytest.raises(RuntimeError, match="boom"), platform.torch_step(16):
        assert torch.get_num_threads() == 1 and not native.gemv_linears
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2 and native.gemv_linears
    assert not route.pending  # the step was timed for the route ...
    assert sum(route.choice.samples.values()) == 1
    assert platform.torch_threads.samples  # ... and for torch's thread choice
    with pytest.raises(RuntimeError, match="boom"), platform.native_step(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    assert native.step_threads.samples  # the native step's time informs its next choice


def test_generate_holds_inference_mode_across_steps(tiny_models) -> None:
    """The runner enters inference mode itself only for callers that do not hold it; the
    tensors of a step are inference tensors either way."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    runner = llm.engine.runner
    at_entry: list[bool] = []
    inside: list[bool] = []
    outer, inner = runner.execute_model, runner._execute_model

    def entered(sched: Any) -> Any:
        at_entry.append(torch.is_inference_mode_enabled())
        return outer(sched)

    def stepped(sched: Any) -> Any:
        inside.append(torch.is_inference_mode_enabled())
        return inner(sched)

    runner.execute_model, runner._execute_model = entered, stepped
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
    assert at_entry and all(at_entry) and all(inside)
    assert not torch.is_inference_mode_enabled()
    at_entry.clear()
    inside.clear()
    llm.engine.add_request("direct", {"prompt_token_ids": [4, 5, 6]}, sp)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()  # a caller without inference mode
    assert at_entry and not any(at_entry) and all(inside)


def test_async_engine_thread_holds_inference_mode_across_steps(tiny_models) -> None:
    """AsyncLLM's engine thread holds inference mode for its life, as LLM.generate does
    across its steps: the runner never enters it per step."""
    import asyncio

    from tinyvllm import AsyncLLM

    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    runner = llm.engine.runner
    at_entry: list[bool] = []
    outer = runner.execute_model

    def entered(sched: Any) -> Any:
        at_entry.append(torch.is_inference_mode_enabled())
        return outer(sched)

    runner.execute_model = entered
    engine = AsyncLLM(llm.engine)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def run() -> None:
        async for _ in engine.generate({"prompt_token_ids": [1, 2, 3]}, sp, "r"):
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown(timeout=30)
    assert at_entry and all(at_entry)
    assert not torch.is_inference_mode_enabled()


@native_only
def test_decode_steps_in_a_row_set_torch_threads_once(
    tiny_models, two_torch_threads, monkeypatch
) -> None:
    """Within LLM.generate each decode step would set torch to one thread and back (two calls
    a step); steps in a row leave it at one until a step wants another count or the loop
    ends, which restores the caller's count."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    seen = _record_steps(llm)
    calls: list[int] = []
    set_threads = torch.set_num_threads

    def counted(count: int) -> None:
        calls.append(count)
        set_threads(count)

    monkeypatch.setattr(torch, "set_num_threads", counted)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
    assert len(seen) == 12 and {threads for _, threads, _ in seen} == {1}
    assert calls == [1, 2]  # into the first step, back when generate returns
    assert torch.get_num_threads() == 2
    calls.clear()
    llm.engine.runner._execute_model = _raising  # the engine fails the step's requests
    (out,) = llm.generate([{"prompt_token_ids": [4, 5, 6]}], sp, use_tqdm=False)
    assert "boom" in (out.error or "")
    assert calls == [1, 2]  # restored when a step raised too


def _raising(sched: Any) -> Any:
    raise RuntimeError("boom")


def test_a_decode_step_after_a_big_step_returns_the_free_heap(
    monkeypatch: pytest.MonkeyPatch, two_torch_threads
) -> None:
    """The freed activations of a big step (kept mapped for the next one) go back to the OS
    when decode-sized steps follow, which grow the KV cache instead: once per such change."""
    import tinyvllm.platforms.cpu as cpu
    from tinyvllm.platforms.cpu import CpuPlatform

    releases: list[int] = []
    monkeypatch.setattr(cpu, "release_free_heap", lambda: releases.append(1) or True)
    platform = CpuPlatform(torch.device("cpu"), torch.float32, None)
    steps = [
        (cpu.HEAP_RELEASE_AFTER_TOKENS - 1, 0),  # a mid-sized step: its activations stay
        (1, 0),
        (cpu.HEAP_RELEASE_AFTER_TOKENS, 0),
        (0, 0),  # an empty step (finished rows dropped) is no decode step
        (1, 1),  # a decode step after a big one
        (cpu.HEAP_RELEASE_STEP_TOKENS, 1),  # more decode steps: nothing left to return
        (cpu.HEAP_RELEASE_AFTER_TOKENS * 4, 1),
        (cpu.HEAP_RELEASE_STEP_TOKENS + 1, 1),  # not decode-sized: the next big step reuses it
        (cpu.HEAP_RELEASE_AFTER_TOKENS, 1),
        (cpu.HEAP_RELEASE_STEP_TOKENS, 2),
    ]
    for tokens, released_before in steps:
        with platform.torch_step(tokens):
            assert len(releases) == released_before, (tokens, releases)
