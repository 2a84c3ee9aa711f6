"""The native CPU decode path (per-layer kernels and the one-call decode program) against
the plain PyTorch path (`enforce_eager=True`) on every tiny model family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures import keep_program_rows, pin_program_route

from tinyvllm import LLM, SamplingParams
from tinyvllm.native.build import unsupported_reason

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)

PROMPT_LENS = (3, 9, 17, 30, 44)


def _prompts(vocab: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(5, vocab, (n,), generator=gen).tolist()}
        for n in PROMPT_LENS
    ]


def _run(llm: LLM, prompts: list[dict], max_tokens: int = 12) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _near_tie_divergence(ref: list, got: list, margin: float) -> None:
    """Tokens must agree until a step where the reference's top-2 logprobs are within
    `margin` (low-precision rounding may flip such a step); beyond it nothing is compared."""
    for r, g in zip(ref, got, strict=True):
        for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids, strict=True)):
            if a == b:
                continue
            top = sorted((lp.logprob for lp in r.logprobs[i].values()), reverse=True)
            assert len(top) >= 2 and top[0] - top[1] < margin, (i, a, b, top)
            break


@pytest.mark.usefixtures("one_torch_thread")
def test_native_matches_eager_fp32(tiny_model_dir: Path) -> None:
    kw = {"dtype": "float32", "max_model_len": 256}
    eager = LLM(str(tiny_model_dir), enforce_eager=True, **kw)
    native = LLM(str(tiny_model_dir), **kw)
    assert native.engine.runner.decode_program is not None
    assert eager.engine.runner.decode_program is None
    prompts = _prompts(native.engine.config.model.vocab_size)
    ref, got = _run(eager, prompts), _run(native, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for r, g in zip(ref, got, strict=True):
        for lr, lg in zip(r.logprobs, g.logprobs, strict=True):
            for tok, lp in lr.items():
                assert abs(lp.logprob - lg[tok].logprob) < 1e-4


@pytest.mark.usefixtures("one_torch_thread")
def test_native_matches_eager_bf16(tiny_models) -> None:
    for family in ("llama", "qwen3"):
        kw = {"dtype": "bfloat16", "max_model_len": 256}
        eager = LLM(str(tiny_models[family]), enforce_eager=True, **kw)
        native = LLM(str(tiny_models[family]), **kw)
        vocab = native.engine.config.model.vocab_size
        prompts = _prompts(vocab, seed=1) + _prompts(vocab, seed=4)  # 10 rows: two GEMV tiles
        _near_tie_divergence(_run(eager, prompts), _run(native, prompts), margin=0.1)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_program_is_bit_identical_to_native_layers(
    tiny_models, dtype: str, monkeypatch
) -> None:
    """The one-call program runs exactly the kernels the per-layer native path runs (given
    the same weight layout: its own pair-layout bf16 GEMM is tested in
    test_native_bf16_pairs.py)."""
    keep_program_rows(monkeypatch)
    for family in ("qwen2", "qwen3", "mistral"):
        llm = LLM(str(tiny_models[family]), dtype=dtype, max_model_len=256)
        pin_program_route(llm)
        prompts = _prompts(llm.engine.config.model.vocab_size, seed=2)
        with_program = _run(llm, prompts)
        llm.engine.runner.decode_program = None
        llm.reset_prefix_cache()
        layers_only = _run(llm, prompts)
        for a, b in zip(with_program, layers_only, strict=True):
            assert a.token_ids == b.token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in a.logprobs] == [
                {t: lp.logprob for t, lp in d.items()} for d in b.logprobs
            ]


@pytest.mark.usefixtures("one_torch_thread")
def test_native_with_preemption_and_chunked_prefill(tiny_models) -> None:
    path = str(tiny_models["llama"])
    kw = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 16}
    eager = LLM(path, enforce_eager=True, **kw)
    # Few blocks: requests get preempted and recomputed mid-decode.
    native = LLM(path, num_gpu_blocks_override=8, **kw)
    prompts = _prompts(native.engine.config.model.vocab_size, seed=3)
    ref, got = _run(eager, prompts, 20), _run(native, prompts, 20)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert native.get_stats().total_preemptions > 0
