"""The decode step's fast paths give what the general paths give.

The runner prepares a CPU decode step's inputs in numpy (`_prepare_decode`), reuses the last
step's sampling metadata while the sampled rows and their parameters stay the same, takes
argmax in numpy and reads finiteness off the sampled logit. Each is checked against the path
it replaces: unit by unit, and end to end with requests joining, finishing and being
preempted mid-stream.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.core.outputs import NewRequestData
from tinyvllm.runner import input_batch, model_runner, sampling
from tinyvllm.runner.input_batch import prepare_inputs
from tinyvllm.runner.states import RequestStates
from tinyvllm.sample import sampler as sampler_module
from tinyvllm.sample.metadata import SamplingMetadata
from tinyvllm.sample.sampler import argmax_rows

CPU = torch.device("cpu")


def _states_mid_stream() -> tuple[RequestStates, list[str]]:
    """Requests at different points: decoding (at and past block boundaries), and one whose
    single scheduled token is a prompt chunk that does not reach the prompt's end."""
    states = RequestStates(8, 129, 8, 1000)
    gen = torch.Generator().manual_seed(0)
    req_ids = []
    # (tokens known, tokens computed): the step computes token `computed`.
    for i, (n, computed) in enumerate([(41, 40), (33, 32), (17, 16), (70, 20), (5, 4)]):
        blocks = torch.randperm(40, generator=gen)[: -(-n // 16)].tolist()
        tokens = torch.randint(0, 999, (n,), generator=gen).tolist()
        num_prompt = n if i == 3 else n - 3  # request 3 is mid-prompt
        new = NewRequestData(
            f"r{i}",
            tokens[:num_prompt],
            tokens[num_prompt:],
            SamplingParams(),
            blocks,
            computed,
            None,
        )
        states.add(new)
        req_ids.append(f"r{i}")
    return states, req_ids


def test_decode_inputs_match_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    states, req_ids = _states_mid_stream()
    taken = []
    decode = input_batch._prepare_decode
    monkeypatch.setattr(input_batch, "_prepare_decode", lambda *a: taken.append(1) or decode(*a))
    # A reordered subset too: the batch order is the scheduler's, not the rows'.
    for ids in (req_ids, [req_ids[4], req_ids[0], req_ids[3]]):
        ones = [1] * len(ids)
        fast = prepare_inputs(states, ids, ones, 16, CPU, device_side=False)
        general = prepare_inputs(states, ids, ones, 16, CPU, device_side=True)
        for name in ("rows", "num_scheduled", "input_ids", "positions"):
            _assert_same(getattr(fast, name), getattr(general, name))
        _assert_same(fast.sample_idx, general.sample_idx)
        _assert_same(fast.logits_indices, general.logits_indices)
        assert fast.row_list == general.row_list == fast.rows.tolist()
        assert fast.sample_list == general.sample_list == fast.sample_idx.tolist()
        fm, gm = fast.attn_metadata, general.attn_metadata
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            _assert_same(getattr(fm, name), getattr(gm, name))
        for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
            assert getattr(fm, name) == getattr(gm, name)
        assert fm.query_start_loc_cpu == gm.query_start_loc_cpu
        assert fm.seq_lens_cpu == gm.seq_lens_cpu
        assert fast.positions.data_ptr() != states.num_computed_tokens.data_ptr()
    assert len(taken) == 2
    # The mid-prompt request does not sample.
    assert 3 not in prepare_inputs(states, req_ids, [1] * 5, 16, CPU).sample_list


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.is_contiguous() == b.is_contiguous()
    assert torch.equal(a, b)


def _tricky_logits(gen: torch.Generator, trial: int) -> torch.Tensor:
    """[7, 301] logits with ties, -inf entries, an all -inf row and (some trials) NaN, +inf."""
    x = torch.randint(-3, 4, (7, 301), generator=gen).float()
    r = torch.rand(7, 301, generator=gen)
    x[r < 0.3] = -float("inf")
    if trial % 3 == 0:
        x[r > 0.995] = float("nan")
    if trial % 4 == 0:
        x[r > 0.99] = float("inf")
    x[trial % 7] = -float("inf")
    return x


def test_numpy_argmax_is_torch_argmax() -> None:
    """First maximal index; NaN counts as the maximum; -inf rows and ties."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        x = _tricky_logits(gen, trial)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        assert torch.equal(argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))
    assert argmax_rows(torch.zeros(0, 5)).shape == (0,)
    bf16 = torch.randn(3, 10, generator=gen).bfloat16()
    assert torch.equal(argmax_rows(bf16), bf16.argmax(dim=-1))


@pytest.mark.parametrize("mode", ["greedy", "random"])
def test_finite_rows_match_the_max(mode: str) -> None:
    logits = torch.randn(6, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = -float("inf")
    logits[4, 9] = -float("inf")
    greedy = mode == "greedy"
    temperature = torch.zeros(6) if greedy else torch.ones(6)
    md = SamplingMetadata(temperature=temperature, all_greedy=greedy, all_random=not greedy)
    tokens = argmax_rows(logits).tolist() if greedy else [0, 1, 2, 3, 4, 5]
    expected = torch.isfinite(logits.amax(dim=-1)).tolist()
    assert expected == [True, False, False, False, True, True]
    assert sampling.finite_rows(logits, tokens, md) == expected


def test_sampling_metadata_is_reused_only_while_rows_and_params_stay() -> None:
    states, _ = _states_mid_stream()
    gen = torch.Generator()
    rows = torch.tensor([0, 1, 2])
    first = sampling.build_sampling_metadata(states, rows, gen)
    assert sampling.build_sampling_metadata(states, rows.clone(), gen) is first
    assert sampling.build_sampling_metadata(states, torch.tensor([0, 1]), gen) is not first
    again = sampling.build_sampling_metadata(states, rows, gen)
    # Row 1 is taken by another request with other parameters: rebuilt, and its values.
    states.remove("r1")
    params = SamplingParams(temperature=0.5, top_k=5)
    states.add(NewRequestData("new", [1, 2, 3], [], params, [9], 2, None))
    assert states.req_id_to_row["new"] == 1
    rebuilt = sampling.build_sampling_metadata(states, rows, gen)
    assert rebuilt is not again and rebuilt.temperature.tolist() == [1.0, 0.5, 1.0]
    assert rebuilt.top_k is not None and rebuilt.top_k.tolist() == [0, 5, 0]
    # Per-step inputs (a seed's generator, penalties' token lists) are never reused.
    states.add(NewRequestData("seeded", [4, 5], [], SamplingParams(seed=3), [8], 1, None))
    states.add(
        NewRequestData("penal", [4, 5], [], SamplingParams(presence_penalty=1.0), [7], 1, None)
    )
    for req in ("seeded", "penal"):
        rows = torch.tensor([0, states.req_id_to_row[req]])
        md = sampling.build_sampling_metadata(states, rows, gen)
        assert sampling.build_sampling_metadata(states, rows, gen) is not md


def test_greedy_tokens_are_the_samplers() -> None:
    """The plain greedy step skips the sampler: same tokens, -1 where the sampler's token
    has a non-finite maximum (ties, NaN, +inf and all -inf rows); anything else samples."""
    gen = torch.Generator().manual_seed(1)
    greedy = SamplingMetadata(temperature=torch.zeros(7), all_greedy=True, all_random=False)
    for trial in range(100):
        logits = _tricky_logits(gen, trial)
        out = sampler_module.Sampler()(logits, greedy)
        expected = out.sampled_token_ids.tolist()
        for i, ok in enumerate(sampling.finite_rows(logits, expected, greedy)):
            expected[i] = expected[i] if ok else -1
        assert sampling.greedy_tokens(logits, greedy) == expected
    others = [
        SamplingMetadata(temperature=torch.zeros(7), all_greedy=True, all_random=False, **kw)
        for kw in (
            {"max_num_logprobs": 0},
            {"presence_penalty": torch.ones(7)},
            {"min_tokens_mask": [(0, [3])]},
        )
    ]
    others.append(SamplingMetadata(temperature=torch.ones(7), all_greedy=False, all_random=True))
    for md in others:
        assert sampling.greedy_tokens(logits, md) is None
    assert sampling.greedy_tokens(logits.bfloat16(), greedy) is None


def _params(vocab: int) -> list[SamplingParams]:
    """Greedy with different lengths (so requests finish at different steps), seeded random,
    penalties, logprobs and min_tokens: the sampled rows change and their metadata with them."""
    return [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=17, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=21, min_tokens=12, stop_token_ids=[vocab - 1]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    ]


def _run_mid_stream(llm: LLM) -> list[tuple[Any, ...]]:
    """Requests join while others decode (one every few steps), finish at different steps."""
    engine = llm.engine
    vocab = engine.config.model.vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (5, 17, 40, 9, 31, 12)]
    pending = list(zip(prompts, _params(vocab), strict=True))
    results: dict[str, Any] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            prompt, params = pending.pop(0)
            engine.add_request(f"q{len(pending)}", {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                comp = out.outputs[0]
                lps = None if comp.logprobs is None else [sorted(d.items()) for d in comp.logprobs]
                results[out.request_id] = (comp.token_ids, comp.finish_reason, lps)
        step += 1
    return [results[k] for k in sorted(results)]


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"num_gpu_blocks_override": 8, "max_model_len": 128}],
    ids=["mid-stream", "preemption"],
)
def test_engine_outputs_same_without_the_fast_paths(
    tiny_models, monkeypatch: pytest.MonkeyPatch, engine_kwargs: dict[str, Any]
) -> None:
    kwargs = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, **engine_kwargs}
    llm = LLM(str(tiny_models["llama"]), **kwargs)
    fast = _run_mid_stream(llm)
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    with monkeypatch.context() as m:
        # The general paths: torch inputs, metadata gathered every step, torch's argmax and max.
        m.setattr(
            model_runner, "prepare_inputs", functools.partial(prepare_inputs, device_side=True)
        )
        m.setattr(model_runner, "build_sampling_metadata", sampling._gather_sampling_metadata)
        m.setattr(sampler_module, "argmax_rows", lambda x: x.argmax(dim=-1))
        m.setattr(
            model_runner,
            "finite_rows",
            lambda logits, tokens, md: torch.isfinite(logits.amax(dim=-1)).tolist(),
        )
        m.setattr(model_runner, "greedy_tokens", lambda logits, md: None)
        general = _run_mid_stream(LLM(str(tiny_models["llama"]), **kwargs))
    assert fast == general
    assert len(fast) == 6 and all(len(tokens) > 0 for tokens, _, _ in fast)


def test_runner_bookkeeping_writes_the_rows(tiny_models) -> None:
    """After every step a decoding request's row holds its tokens and computed count, as the
    scheduler has them (the numpy views write the tensors the general paths read)."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=256)
    engine, states = llm.engine, llm.engine.runner.states
    assert np.shares_memory(states.np_token_ids, states.token_ids.numpy())
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [11, 12, 13, 14, 15]}, params)
    engine.add_request("b", {"prompt_token_ids": list(range(20, 50))}, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for rid, request in engine.scheduler.requests.items():
            row = states.req_id_to_row[rid]
            tokens = request.all_token_ids
            assert states.token_ids[row, : len(tokens)].tolist() == tokens
            assert int(states.num_tokens[row]) == len(tokens)
            assert int(states.num_computed_tokens[row]) == request.num_computed_tokens
            checked += 1
    assert checked >= 30


@pytest.fixture(scope="module")
def q8_gguf(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> str:
    import gguf
    from gguf_writer import write_tiny_gguf

    path = tmp_path_factory.mktemp("q8") / "tiny.gguf"
    write_tiny_gguf(tiny_models["llama"], path, lambda n, w: gguf.GGMLQuantizationType.Q8_0)
    return str(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8_activations"])
def test_decode_logits_are_compute_logits(q8_gguf: str, dtype: str, int8: bool) -> None:
    """The lm_head GEMV into persistent buffers gives `compute_logits` bit for bit, at every
    row count it takes; others (and non-contiguous rows) go back to `compute_logits`."""
    from tinyvllm.models.llama import LlamaForCausalLM
    from tinyvllm.runner.decode_logits import DecodeLogits

    llm = LLM(q8_gguf, dtype=dtype, max_model_len=128, int8_activations=int8)
    runner = llm.engine.runner
    head, model = runner.decode_logits, runner.model
    assert head is not None and head.code == model.lm_head.qweight.packed.gemv_code
    hidden_size = model.lm_head.input_size
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 5, 64, 2):
            hidden = torch.randn(rows, hidden_size, generator=gen).to(
                model.lm_head.qweight.packed.model_dtype
            )
            got = head(hidden)
            assert got is not None and got.dtype == torch.float32
            assert torch.equal(got, model.compute_logits(hidden))
        assert head(torch.randn(65, hidden_size).to(hidden.dtype)) is None
        assert head(torch.randn(hidden_size, 2).to(hidden.dtype).t()) is None
    # A model whose compute_logits does more than the head (e.g. a soft cap) keeps it.

    class Capped(LlamaForCausalLM):
        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return torch.tanh(super().compute_logits(hidden))

    assert DecodeLogits.build(Capped.__new__(Capped)) is None


def test_gguf_engine_outputs_same_without_decode_logits(q8_gguf: str) -> None:
    kwargs = {"dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": 4}
    llm = LLM(q8_gguf, **kwargs)
    assert llm.engine.runner.decode_logits is not None
    fast = _run_mid_stream(llm)
    llm.engine.runner.decode_logits = None
    assert _run_mid_stream(llm) == fast
