"""End to end: tinyvllm against HF transformers, and every scheduling path against itself."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tinyvllm import LLM, RequestOutputKind, SamplingParams
from tinyvllm.engine.engine import Engine, child_request_id
from tinyvllm.parity import hf_greedy, hf_token_logprobs, load_hf_reference

# Lengths chosen to cross 16-token block boundaries (and the mistral fixture's window of 8).
PROMPT_LENGTHS = (5, 16, 17, 40, 71)
MAX_TOKENS = 20


def make_prompts(vocab: int, lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def llama_llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256)


def test_greedy_and_logprobs_match_hf(tiny_model_dir: Path) -> None:
    """Batched prompts of different lengths: tokens identical, logprobs within 1e-3."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256)
    hf = load_hf_reference(str(tiny_model_dir))
    prompts = make_prompts(llm.engine.config.model.vocab_size)
    outs = run(llm, prompts, greedy(logprobs=3))
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
        ref = hf_token_logprobs(hf, prompt, comp.token_ids)
        ours = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-3
        # Greedy picks the top token, and the top-3 come back ranked.
        for t, lp in zip(comp.token_ids, comp.logprobs, strict=True):
            assert lp[t].rank == 1
            assert sorted(x.rank for x in lp.values()) == [1, 2, 3]


def test_prompt_logprobs_match_hf(tiny_models) -> None:
    import torch

    path = str(tiny_models["qwen2"])
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    hf = load_hf_reference(path)
    prompt = make_prompts(llm.engine.config.model.vocab_size, (37,))[0]
    out = run(llm, [prompt], greedy(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - float(ref[pos - 1, prompt[pos]])) < 1e-3
        top = int(ref[pos - 1].argmax())
        assert top in entry and entry[top].rank == 1


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"max_num_batched_tokens": 7},  # chunked prefill in small, unaligned chunks
        {"max_num_seqs": 1},
        {"num_gpu_blocks_override": 16, "max_model_len": 128},  # forces preemption
        {"block_size": 8},
    ],
    ids=["chunked", "max_num_seqs=1", "preemption", "block_size=8"],
)
def test_scheduling_paths_keep_greedy_outputs(tiny_models, llama_llm, engine_kwargs) -> None:
    prompts = make_prompts(llama_llm.engine.config.model.vocab_size)
    params = greedy(max_tokens=40)
    expected = token_ids(run(llama_llm, prompts, params))
    kwargs = {"dtype": "float32", "max_model_len": 256, **engine_kwargs}
    llm = LLM(str(tiny_models["llama"]), **kwargs)
    assert token_ids(run(llm, prompts, params)) == expected
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_sliding_window_with_chunked_prefill(tiny_models) -> None:
    path = str(tiny_models["mistral"])
    hf = load_hf_reference(path)
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=5)
    prompts = make_prompts(llm.engine.config.model.vocab_size, (23, 9))
    for prompt, out in zip(prompts, run(llm, prompts, greedy()), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)


def test_seeded_sampling_independent_of_batch(llama_llm) -> None:
    vocab = llama_llm.engine.config.model.vocab_size
    prompt = make_prompts(vocab, (12,))[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = token_ids(run(llama_llm, [prompt], params))[0]
    others = make_prompts(vocab, (3, 30, 7), seed=5)
    mixed = run(
        llama_llm,
        [*others[:2], prompt, others[2]],
        [SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)] * 2
        + [params]
        + [greedy()],
    )
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert token_ids(run(llama_llm, [prompt], other_seed))[0] != alone


def test_seeded_sampling_survives_preemption(tiny_models, llama_llm) -> None:
    vocab = llama_llm.engine.config.model.vocab_size
    prompts = make_prompts(vocab)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
        for i in range(len(prompts))
    ]
    expected = token_ids(run(llama_llm, prompts, params))
    small = LLM(
        str(tiny_models["llama"]), dtype="float32", max_model_len=128, num_gpu_blocks_override=16
    )
    assert token_ids(run(small, prompts, params)) == expected
    assert small.engine.scheduler.num_preemptions > 0


def test_n_samples_and_stop_conditions(llama_llm) -> None:
    vocab = llama_llm.engine.config.model.vocab_size
    prompt = make_prompts(vocab, (10,))[0]
    out = run(llama_llm, [prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1

    ref = token_ids(run(llama_llm, [prompt], greedy()))[0]
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    stopped = run(llama_llm, [prompt], greedy(stop_token_ids=[stop_tok]))[0].outputs[0]
    assert stopped.token_ids == ref[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok
    # min_tokens masks stop ids until reached, so the stop token cannot come early.
    later = run(llama_llm, [prompt], greedy(stop_token_ids=[stop_tok], min_tokens=first + 2))
    assert stop_tok not in later[0].outputs[0].token_ids[: first + 2]
    capped = run(llama_llm, [prompt], greedy(max_tokens=3))[0].outputs[0]
    assert capped.token_ids == ref[:3] and capped.finish_reason == "length"


def test_stop_string_across_tokens_and_streaming(llama_llm) -> None:
    tok = llama_llm.get_tokenizer()
    prompt = "def main():\n    x = 1\n"
    full = llama_llm.generate(prompt, greedy(max_tokens=24), use_tqdm=False)[0].outputs[0]
    text = full.text
    # A stop string that straddles a token boundary: the end of one token's text plus the
    # start of the next.
    pieces = [tok.decode([t]) for t in full.token_ids]
    k = next(i for i in range(2, len(pieces)) if len(pieces[i - 1]) and len(pieces[i]))
    start = len("".join(pieces[: k - 1]))
    stop = text[start + len(pieces[k - 1]) - 1 : start + len(pieces[k - 1]) + 1]
    assert len(stop) == 2
    out = llama_llm.generate(prompt, greedy(max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == text[: text.index(stop)]

    # DELTA streaming through Engine.step reassembles the same text.
    engine: Engine = llama_llm.engine
    params = greedy(max_tokens=24)
    params.output_kind = RequestOutputKind.DELTA
    engine.add_request("stream", prompt, params)
    pieces_out, ids = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            pieces_out.append(o.outputs[0].text)
            ids.extend(o.outputs[0].token_ids)
    assert "".join(pieces_out) == text and ids == full.token_ids


def test_chat_uses_template(llama_llm) -> None:
    tok = llama_llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello"}]
    out = llama_llm.chat(messages, greedy(max_tokens=4), use_tqdm=False)[0]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)


def test_chat_stops_a_runaway_template(llama_llm) -> None:
    # A nested loop with no output and no call per iteration once hung llm.chat for hours.
    nested = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ValueError, match="chat template ran longer than"):
        llama_llm.chat([{"role": "user", "content": "hi"}], chat_template=nested, use_tqdm=False)
    assert time.monotonic() - start < 15


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"prompt_token_ids": [5] * 300}, "longer than max_model_len=256"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ("", "prompt is empty"),
        ({"prompt_token_ids": [5, 99999]}, "out-of-vocabulary id"),
        ({"tokens": [1]}, "'prompt' or 'prompt_token_ids'"),
    ],
)
def test_bad_prompts_raise_clear_errors(llama_llm, prompt, match) -> None:
    with pytest.raises(ValueError, match=match):
        llama_llm.generate(prompt, greedy(), use_tqdm=False)
    assert not llama_llm.engine.has_unfinished_requests()


def test_bad_request_does_not_affect_others(llama_llm) -> None:
    engine: Engine = llama_llm.engine
    prompts = make_prompts(engine.config.model.vocab_size, (9, 20))
    expected = token_ids(run(llama_llm, prompts, greedy()))
    params = greedy()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    engine.add_request("good0", {"prompt_token_ids": prompts[0]}, params)
    with pytest.raises(ValueError, match="out-of-vocabulary"):
        engine.add_request("bad", {"prompt_token_ids": [10**6]}, params)
    engine.add_request("good1", {"prompt_token_ids": prompts[1]}, params)
    # A request whose output processing raises ends with an error; the others finish.
    engine.add_request("boom", {"prompt_token_ids": prompts[0]}, params)
    child = engine.output_processor.children[child_request_id("boom", 0)]

    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("detokenizer exploded")

    child.detokenizer.update = explode  # type: ignore[method-assign]
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    assert results["boom"].error and "detokenizer exploded" in results["boom"].error
    assert results["boom"].outputs[0].finish_reason == "error"
    assert [results["good0"].outputs[0].token_ids, results["good1"].outputs[0].token_ids] == (
        expected
    )
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_abort_frees_blocks(llama_llm) -> None:
    engine: Engine = llama_llm.engine
    engine.add_request("a", {"prompt_token_ids": [11] * 40}, greedy(max_tokens=50))
    engine.step()
    assert engine.kv_cache_manager.pool.num_free_blocks < engine.kv_cache_manager.pool.num_blocks
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    engine.step()  # the runner drops the row
    assert len(engine.runner.states) == 0
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_unknown_engine_argument(tiny_models) -> None:
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tiny_models["llama"]), max_modle_len=10)


def test_default_context_shrinks_to_fit_kv(tiny_models, caplog) -> None:
    path = str(tiny_models["llama"])
    per_token = 2 * 3 * 2 * 16 * 4  # K+V, 3 layers, 2 kv heads, head_dim 16, fp32
    budget = 10 * 16 * per_token  # ten 16-token blocks
    with caplog.at_level("WARNING"):
        llm = LLM(path, dtype="float32", kv_cache_memory_bytes=budget)
    assert llm.engine.config.model.max_model_len == 160
    assert "max_model_len=160" in caplog.text
    with pytest.raises(ValueError, match="lower max_model_len"):
        LLM(path, dtype="float32", kv_cache_memory_bytes=budget, max_model_len=512)


def test_runner_hands_back_the_kv_size_instead_of_writing_config(tiny_models) -> None:
    from dataclasses import asdict, replace

    from tinyvllm.config import EngineArgs
    from tinyvllm.engine.setup import build_engine_config

    per_token = 2 * 3 * 2 * 16 * 4  # K+V, 3 layers, 2 kv heads, head_dim 16, fp32
    args = EngineArgs(
        str(tiny_models["llama"]), dtype="float32", kv_cache_memory_bytes=10 * 16 * per_token
    )
    config = build_engine_config(args)
    # A context the ten blocks cannot hold, left to the model: the runner shrinks it.
    config = replace(
        config,
        model=replace(config.model, max_model_len=256, max_model_len_explicit=False),
        scheduler=replace(config.scheduler, max_model_len=256),
    )
    before = (asdict(config.cache), asdict(config.scheduler), config.model.max_model_len)
    engine = Engine(config, tokenizer=None)
    assert (asdict(config.cache), asdict(config.scheduler), config.model.max_model_len) == before
    assert engine.config.model.max_model_len == engine.config.scheduler.max_model_len == 160
    assert engine.scheduler.config.max_model_len == 160
    assert engine.get_stats().num_blocks == 10


def test_fp32_gemm_copies_serve_batched_rows() -> None:
    import torch

    from tinyvllm.models.layers.linear import ReplicatedLinear, attach_fp32_gemm_weights

    layer = ReplicatedLinear(32, 24, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    assert attach_fp32_gemm_weights(layer, min_rows=4) == 24 * 32 * 4
    x = torch.randn(4, 32).bfloat16()
    exact = x.double() @ layer.weight.double().T + layer.bias.double()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and layer.fp32_copy is not None
    # fp32 sums of the bf16 products, rounded once to bf16: within half a bf16 ulp and a bit.
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-6)
    one = x[:1]
    assert torch.equal(layer(one), torch.nn.functional.linear(one, layer.weight, layer.bias))


def test_fp32_gemm_copies_are_made_on_first_use_within_the_budget(tiny_models, monkeypatch) -> None:
    """fp32_weight_copy_bytes caps the copies; a layer takes its copy at its first batched
    GEMM, so layers that only see decode-sized inputs (a chat's lm_head) never do."""
    import torch

    import tinyvllm.platforms.cpu as cpu_platform
    from tinyvllm.models.layers.linear import (
        Fp32CopyBudget,
        LinearBase,
        ReplicatedLinear,
        attach_fp32_gemm_weights,
    )

    layers = [ReplicatedLinear(32, 24, bias=False).to(torch.bfloat16) for _ in range(3)]
    layer_bytes = 24 * 32 * 4
    budget = Fp32CopyBudget(2 * layer_bytes + 10)
    assert attach_fp32_gemm_weights(torch.nn.Sequential(*layers), 8, budget) == 3 * layer_bytes
    assert all(m.fp32_copy is None for m in layers)  # nothing made yet
    with torch.no_grad():
        for m in layers:
            m(torch.randn(2, 32).bfloat16())  # decode-sized: no copy
        assert all(m.fp32_copy is None for m in layers)
        for m in layers:
            m(torch.randn(8, 32).bfloat16())
    assert [m.fp32_copy is not None for m in layers] == [True, True, False]
    assert budget.spent == 2 * layer_bytes

    monkeypatch.setattr(cpu_platform, "has_native_bf16_matmul", lambda: False)
    # Past the native program's steps (64 tokens, 128 with its bf16 pair-layout copies).
    long_prompt = {"prompt_token_ids": list(range(1, 151))}

    def copies(**kwargs: Any) -> tuple[int, bool]:
        llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", max_model_len=160, **kwargs)
        model = llm.engine.runner.model
        llm.generate([long_prompt], greedy(max_tokens=2), use_tqdm=False)
        linears = [m for m in model.modules() if isinstance(m, LinearBase)]
        made = sum(m.fp32_copy.nbytes for m in linears if m.fp32_copy is not None)
        return made, model.lm_head.fp32_copy is not None

    everything, lm_head = copies()
    assert everything > 0 and not lm_head  # the lm_head saw one row per step
    assert copies(fp32_weight_copy_bytes=0)[0] == 0
    assert 0 < copies(fp32_weight_copy_bytes=everything // 2)[0] <= everything // 2
    with pytest.raises(ValueError, match="fp32_weight_copy_bytes"):
        LLM(str(tiny_models["llama"]), fp32_weight_copy_bytes=-1)


def test_token_ids_only_engine_returns_logprobs(tiny_models) -> None:
    llm = LLM(
        str(tiny_models["llama"]), dtype="float32", max_model_len=128, skip_tokenizer_init=True
    )
    out = run(llm, [[11, 12, 13, 14]], greedy(max_tokens=4, logprobs=2))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text == ""
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp[tok].rank == 1 and lp[tok].decoded_token is None
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("text prompt", greedy(), use_tqdm=False)


def test_decode_groups_and_unsorted_batches(llama_llm, monkeypatch) -> None:
    """Decode attention split into several length groups, with the batch not in length order."""
    import tinyvllm.attention.torch_attn as torch_attn

    vocab = llama_llm.engine.config.model.vocab_size
    prompts = make_prompts(vocab, (70, 5, 33, 17, 50, 9))
    expected = token_ids(run(llama_llm, prompts, greedy()))
    monkeypatch.setattr(torch_attn, "_DECODE_GROUP_TOKENS", 64)
    assert token_ids(run(llama_llm, prompts, greedy())) == expected


def test_generation_config_eos_ids_read_without_transformers(tmp_path: Path) -> None:
    """EOS ids besides the tokenizer's come from generation_config.json, read as JSON (as
    transformers' GenerationConfig reads them, without its second of imports)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from tinyvllm.engine.setup import generation_config_eos

    config = SimpleNamespace(model=SimpleNamespace(model_path=str(tmp_path)))
    assert generation_config_eos(config, 2) == set()  # no file (a GGUF checkpoint)
    for ids in (7, [2, 7, 9], [], None):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
        reference = GenerationConfig.from_pretrained(tmp_path).eos_token_id
        reference = [reference] if isinstance(reference, int) else reference or []
        expected = set(reference)
        assert generation_config_eos(config, 2) == expected - {2}, ids
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_config_eos(config, 2) == set()
