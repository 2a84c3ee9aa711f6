"""LFM2 (short-conv + attention hybrid) against HF transformers on the same random weights,
under every schedule that moves recurrent state around: batching, small chunks, preemption,
one sequence at a time, and prefix caching of state snapshots ("align" mode)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fixtures import keep_program_rows, pin_program_route
from lfm2_checkpoint import build_tiny_lfm2

from tinyvllm import LLM, SamplingParams
from tinyvllm.parity import hf_greedy, hf_token_logprobs, load_hf_reference

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_lfm2(tmp_path_factory.mktemp("lfm2"), tokenizer_dir)


@pytest.fixture(scope="module")
def hf_lfm2(lfm2_dir: Path):
    return load_hf_reference(str(lfm2_dir))


def _prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(10, 1900) for _ in range(n)] for n in lengths]


def _llm(path: Path, **kw: object) -> LLM:
    args = {"dtype": "float32", "max_model_len": 256, "block_size": 16, "enforce_eager": True}
    return LLM(str(path), **{**args, **kw})


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **kw: object):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _ids(llm: LLM, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    return [list(c.token_ids) for c in _greedy(llm, prompts, **kw)]


# Several blocks, one block exactly, under a block; batched with different lengths.
PROMPTS = _prompts(0, [5, 16, 37, 70])


@pytest.fixture(scope="module")
def hf_expected(hf_lfm2) -> list[list[int]]:
    return [hf_greedy(hf_lfm2, p, MAX_TOKENS) for p in PROMPTS]


def test_greedy_and_logprobs_match_hf(lfm2_dir: Path, hf_lfm2, hf_expected) -> None:
    _assert_like_hf(_llm(lfm2_dir), hf_lfm2, hf_expected)


def _assert_like_hf(llm: LLM, hf_lfm2, hf_expected: list[list[int]]) -> None:
    """Greedy tokens of PROMPTS as HF's, logprobs within 1e-3."""
    outs = _greedy(llm, PROMPTS, logprobs=0)
    assert [list(c.token_ids) for c in outs] == hf_expected
    for prompt, comp in zip(PROMPTS, outs, strict=True):
        ours = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        ref = hf_token_logprobs(hf_lfm2, prompt, list(comp.token_ids))
        assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-3


@pytest.mark.parametrize(
    "engine_kw",
    [
        # Chunks smaller than a block (no boundary to align to) and between blocks.
        pytest.param({"max_num_batched_tokens": 7}, marks=pytest.mark.slow),
        {"max_num_batched_tokens": 40},
        {"max_num_seqs": 1},
        # 9 blocks of 16 cannot hold all four requests: preemption and recompute.
        {"num_gpu_blocks_override": 9, "max_model_len": 96},
        # The native CPU kernels (norms, linear layers) where they load.
        {"enforce_eager": False},
    ],
    ids=["chunk7", "chunk40", "one_seq", "preempt", "native"],
)
def test_schedules_match_hf(lfm2_dir: Path, hf_expected, engine_kw: dict) -> None:
    llm = _llm(lfm2_dir, **engine_kw)
    assert _ids(llm, PROMPTS) == hf_expected
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.get_stats().total_preemptions > 0


def test_prefix_caching_on_off_identical_and_hits(lfm2_dir: Path) -> None:
    system = _prompts(1, [45])[0]
    prompts = _prompts(2, [3, 12, 20, 31, 7, 16], prefix=system)
    off = _llm(lfm2_dir, enable_prefix_caching=False)
    on = _llm(lfm2_dir)
    expected = _ids(off, prompts)
    # One batch: requests sharing a prefix in one step never read an unwritten snapshot.
    assert _ids(on, prompts) == expected
    before = on.get_stats()
    # Across batches: the same prompts again hit their own snapshots.
    assert _ids(on, prompts[::-1]) == expected[::-1]
    after = on.get_stats()
    assert after.prefix_hits - before.prefix_hits >= 6 * 48
    assert after.state_hits - before.state_hits == 6
    assert after.state_snapshots_cached > 0
    blocks = on.get_stats(include_blocks=True).blocks
    assert sum(b.state_snapshot for b in blocks) == after.state_snapshots_cached
    on.reset_prefix_cache()
    assert on.get_stats().state_snapshots_cached == 0
    assert _ids(on, prompts[:2]) == expected[:2]


def test_restored_snapshot_continues_like_hf_cache(lfm2_dir: Path, hf_lfm2) -> None:
    """A request extending an earlier prompt resumes from that prompt's snapshot (48 tokens:
    its last full block before the last token), computes only the 3 tokens after it, and
    matches HF continuing its own cache from token 48 (tokens and logprobs)."""
    first = _prompts(3, [50])[0]
    extended = [*first, 77]
    llm = _llm(lfm2_dir)
    _ids(llm, [first], max_tokens=1)
    stats = llm.get_stats()
    (comp,) = _greedy(llm, [extended], logprobs=0)
    expected, expected_lps = _hf_cache_continuation(hf_lfm2, extended, 48)
    assert list(comp.token_ids) == expected
    ours = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
    assert max(abs(a - b) for a, b in zip(ours, expected_lps, strict=True)) < 1e-3
    after = llm.get_stats()
    assert after.state_hits == stats.state_hits + 1
    assert after.prefix_hits - stats.prefix_hits == 48


def _hf_cache_continuation(
    hf_model, prompt: list[int], split: int
) -> tuple[list[int], list[float]]:
    """HF greedy (tokens, logprobs) where the prompt is fed as prompt[:split], then the rest
    onto its cache."""
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([prompt[:split]]), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        out = hf_model(input_ids=torch.tensor([prompt[split:]]), cache=cache, use_cache=True)
        tokens, logprobs = [], []
        for _ in range(MAX_TOKENS):
            lp = out.logits[0, -1].float().log_softmax(-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp[tokens[-1]]))
            cache = getattr(out, "cache", None) or out.past_key_values
            out = hf_model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
    return tokens, logprobs


def test_mamba_cache_mode_none_caches_no_prefix(lfm2_dir: Path, hf_expected) -> None:
    llm = _llm(lfm2_dir, mamba_cache_mode="none")
    assert _ids(llm, PROMPTS) == hf_expected
    assert _ids(llm, PROMPTS) == hf_expected
    stats = llm.get_stats()
    assert stats.prefix_hits == 0 and stats.state_hits == 0
    assert not stats.prefix_cache_enabled


@pytest.mark.slow
def test_seeded_sampling_and_n_unchanged_by_caching(lfm2_dir: Path) -> None:
    prompts = _prompts(5, [40, 40], prefix=_prompts(6, [33])[0])
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=2, logprobs=1)

    def run(llm: LLM) -> list[list[list[int]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    expected = run(_llm(lfm2_dir, enable_prefix_caching=False))
    on = _llm(lfm2_dir)
    assert run(on) == expected
    assert run(on) == expected


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"layer_types": ["conv", "mamba", "full_attention", "conv", "full_attention", "conv"]},
            "layer_types[1] is '",  # transformers may rename the unknown type on load
        ),
        # transformers itself refuses this one on load; either message names layer_types.
        ({"layer_types": ["conv", "full_attention"]}, "layer_types"),
        ({"full_attn_idxs": [1, 4]}, "inconsistent"),
    ],
    ids=["unknown_type", "wrong_length", "idxs_disagree"],
)
def test_bad_layer_types_fail_at_load(
    lfm2_dir: Path, tmp_path: Path, changes: dict, message: str
) -> None:
    bad = _edit_config(lfm2_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _llm(bad)


def test_layer_types_checked_without_transformers() -> None:
    from types import SimpleNamespace

    from tinyvllm.models.lfm2 import lfm2_layer_types

    config = SimpleNamespace(num_hidden_layers=3, layer_types=["conv", "full_attention"])
    with pytest.raises(ValueError, match="layer_types has 2 entries but num_hidden_layers is 3"):
        lfm2_layer_types(config)
    config = SimpleNamespace(num_hidden_layers=2, layer_types=["conv", "conv"])
    with pytest.raises(ValueError, match="no full_attention layer"):
        lfm2_layer_types(config)
    config = SimpleNamespace(num_hidden_layers=2, layer_types=None, full_attn_idxs=[1])
    assert lfm2_layer_types(config) == ["conv", "full_attention"]


def test_speculative_decoding_refused(lfm2_dir: Path) -> None:
    with pytest.raises(ValueError, match="cannot roll back rejected draft tokens"):
        _llm(lfm2_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_pooling_runner_refused(lfm2_dir: Path) -> None:
    # The pooling runner keeps no recurrent state: a hybrid generates only.
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM cannot run as a pooling model"):
        _llm(lfm2_dir, runner="pooling")


def test_gguf_lfm2_is_refused_clearly(tiny_models, tmp_path: Path) -> None:
    from gguf_writer import write_tiny_gguf

    path = write_tiny_gguf(tiny_models["llama"], tmp_path / "lfm2.gguf", architecture="lfm2")
    with pytest.raises(ValueError, match=r"'lfm2' .* not supported yet from GGUF files"):
        LLM(str(path))


def test_random_add_abort_preempt_leaks_no_state_slot(lfm2_dir: Path) -> None:
    """Engine-level churn on a tight KV budget: aborts mid-prefill and mid-decode,
    preemptions, shared prefixes; every state slot and snapshot pin comes back."""
    llm = _llm(lfm2_dir, num_gpu_blocks_override=10, max_model_len=96, max_num_batched_tokens=24)
    engine = llm.engine
    rng = random.Random(7)
    system = _prompts(8, [20])[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    live: list[str] = []
    for i in range(40):
        op = rng.random()
        if op < 0.45:
            prompt = system[: rng.randint(0, 20)] + _prompts(100 + i, [rng.randint(10, 40)])[0]
            live.append(engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params))
        elif op < 0.5 and live:
            engine.abort_request([live.pop(rng.randrange(len(live)))])
        else:
            engine.step()
        kv = engine.kv_cache_manager
        kv.states.check_invariants(set(kv._blocks))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # an empty step releases the last step's restore pins
    stats = llm.get_stats()
    assert stats.state_running_slots_used == 0 and stats.num_used_blocks == 0
    assert stats.total_preemptions > 0
    snapshots = engine.kv_cache_manager.states.snapshots
    assert snapshots is not None and sum(snapshots.ref_counts) == 0


def test_decode_steps_run_torch_single_threaded_beside_native_layer_ops(lfm2_dir: Path) -> None:
    """Without a decode program, decode-sized steps still keep torch's OpenMP workers off the
    cores the native layer kernels use (they cost milliseconds per op under load)."""
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here anyway")
    llm = _llm(lfm2_dir, enforce_eager=False)
    runner = llm.engine.runner
    if not runner.platform.native_layer_ops:
        pytest.skip("the native kernels did not load here")
    runner.decode_program = None  # the per-layer path (models the program cannot run)
    seen: list[tuple[int, int]] = []
    inner = runner._execute_model

    def record(sched):
        seen.append((sched.total_num_scheduled_tokens, torch.get_num_threads()))
        return inner(sched)

    runner._execute_model = record
    _ids(llm, [PROMPTS[3]], max_tokens=3)
    assert seen[0][0] == 64 and seen[0][1] > 1  # the prompt's chunk: torch's threads
    assert all(threads == 1 for n, threads in seen if n == 1)


def test_mamba_cache_mode_is_validated(lfm2_dir: Path) -> None:
    with pytest.raises(ValueError, match="mamba_cache_mode must be one of align, none, got 'all'"):
        _llm(lfm2_dir, mamba_cache_mode="all")


def _count_program_steps(llm: LLM) -> tuple[list[int], list[int]]:
    """Wraps the runner's steps and its native decode program: the token counts of every
    step the program should run (up to its row limit) and of those it ran."""
    runner = llm.engine.runner
    if not runner.platform.native_layer_ops:
        pytest.skip("the native kernels did not load here")
    program = runner.decode_program
    assert program is not None, "LFM2 got no native decode program"
    pin_program_route(llm)
    expected: list[int] = []
    ran: list[int] = []
    run, execute = program.run, runner._execute_model

    def counted(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        ran.append(input_ids.shape[0])
        return run(input_ids, *args)

    def step(sched):
        if 0 < sched.total_num_scheduled_tokens <= program.max_rows:
            expected.append(sched.total_num_scheduled_tokens)
        return execute(sched)

    program.run = counted  # type: ignore[method-assign]
    runner._execute_model = step
    return expected, ran


def test_native_decode_program_runs_lfm2_like_hf(lfm2_dir: Path, hf_lfm2, hf_expected) -> None:
    """The whole decode step (short-conv and attention layers) runs as one native call, with
    each request's conv state in its slot: tokens as HF's, logprobs within 1e-3."""
    llm = _llm(lfm2_dir, enforce_eager=False)
    expected, ran = _count_program_steps(llm)
    _assert_like_hf(llm, hf_lfm2, hf_expected)
    assert ran == expected and ran.count(len(PROMPTS)) >= MAX_TOKENS // 2


@pytest.mark.parametrize(
    "engine_kw",
    [{"max_num_batched_tokens": 7}, {"num_gpu_blocks_override": 9, "max_model_len": 96}],
    ids=["chunk7", "preempt"],
)
def test_native_decode_program_prefill_chunks_and_preemption(
    lfm2_dir: Path, hf_expected, engine_kw: dict
) -> None:
    """Short prefill chunks (state carried between chunks, zeroed for a fresh request) and
    recompute after preemption also run in the program."""
    llm = _llm(lfm2_dir, enforce_eager=False, **engine_kw)
    expected, ran = _count_program_steps(llm)
    assert _ids(llm, PROMPTS) == hf_expected
    assert ran == expected and max(ran) > len(PROMPTS)  # prefill chunks among them


def test_native_decode_program_resumes_a_state_snapshot(lfm2_dir: Path) -> None:
    """A prefix-cache hit restores the conv state into the slot the program then reads."""
    system = _prompts(1, [45])[0]
    prompts = _prompts(2, [3, 12, 20], prefix=system)
    expected = _ids(_llm(lfm2_dir, enable_prefix_caching=False), prompts)
    llm = _llm(lfm2_dir, enforce_eager=False)
    planned, ran = _count_program_steps(llm)
    assert _ids(llm, prompts) == expected
    before = llm.get_stats().state_hits
    assert _ids(llm, prompts[::-1]) == expected[::-1]
    assert llm.get_stats().state_hits - before == 3 and ran == planned and ran


def test_native_decode_program_matches_the_layer_path_in_bf16(
    lfm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16: the program rounds like ShortConv's torch ops, so tokens and logprobs equal the
    per-layer path's (same kernels for linears, norms and attention, the weights in the same
    rows)."""
    keep_program_rows(monkeypatch)
    program_llm = _llm(lfm2_dir, enforce_eager=False, dtype="bfloat16")
    expected, ran = _count_program_steps(program_llm)
    layer_llm = _llm(lfm2_dir, enforce_eager=False, dtype="bfloat16")
    layer_llm.engine.runner.decode_program = None
    ours = _greedy(program_llm, PROMPTS, logprobs=0)
    ref = _greedy(layer_llm, PROMPTS, logprobs=0)
    assert ran == expected and ran
    for a, b in zip(ours, ref, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        lps_a = [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids, strict=True)]
        lps_b = [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids, strict=True)]
        assert lps_a == lps_b


def test_native_decode_program_conv_bias_and_longer_kernel(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Kernel 4 (a 3-input state) with conv and projection biases, through the program."""
    path = build_tiny_lfm2(tmp_path, tokenizer_dir, seed=3, conv_L_cache=4, conv_bias=True)
    hf = load_hf_reference(str(path))
    prompts = PROMPTS[:3]
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = _llm(path, enforce_eager=False)
    planned, ran = _count_program_steps(llm)
    assert _ids(llm, prompts) == expected
    assert ran == planned and ran
