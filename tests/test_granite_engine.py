"""Granite 4.0-H through the whole engine against HF transformers on the same random weights:
batched prompts of different lengths, small prefill chunks, preemption, one sequence at a time,
and prefix caching of Mamba2 state snapshots on vs off."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from granite_hybrid_fixtures import build_granite_checkpoint

from tinyvllm import LLM, SamplingParams
from tinyvllm.parity import hf_greedy, hf_token_logprobs, load_hf_reference

MAX_TOKENS = 8
# Under one block, exactly one, several; SSD chunks of 8 inside each.
PROMPT_LENGTHS = [6, 16, 35, 61]


def token_prompts(seed: int, lengths: list[int], prefix: list[int] = ()) -> list[list[int]]:  # type: ignore[assignment]
    rng = random.Random(seed)
    return [[*prefix, *(rng.randrange(10, 1900) for _ in range(n))] for n in lengths]


def make_llm(model_dir: Path, **overrides: Any) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 256, "block_size": 16, "enforce_eager": True}
    return LLM(str(model_dir), **{**kwargs, **overrides})


def greedy(llm: LLM, prompts: list[list[int]], **params: Any) -> list[Any]:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [out.outputs[0] for out in outs]


def token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(c.token_ids) for c in greedy(llm, prompts)]


# MoE with rope and attention in the middle; dense, no positions, attention first and last.
# (Untied heads: random tied embeddings scaled by embedding_multiplier make greedy repeat the
# input token, which would test little.)
VARIANTS: dict[str, dict[str, Any]] = {
    "moe": {},
    "dense": dict(
        num_local_experts=0,
        layer_types=["attention", "mamba", "mamba", "attention"],
        position_embedding_type=None,
    ),
}


# The MoE variant's engine runs are slow on a small CPU (test_granite_moe_hybrid.py checks its
# forward against HF step by step in the default suite).
@pytest.fixture(scope="module", params=["dense", pytest.param("moe", marks=pytest.mark.slow)])
def granite(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, Any, list[list[int]]]:
    """(checkpoint, HF model, HF greedy tokens for PROMPT_LENGTHS)."""
    out = tmp_path_factory.mktemp(f"granite-{request.param}")
    model_dir = build_granite_checkpoint(out, tokenizer_dir, **VARIANTS[request.param])
    hf = load_hf_reference(str(model_dir))
    prompts = token_prompts(0, PROMPT_LENGTHS)
    return model_dir, hf, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_greedy_and_logprobs_match_hf(granite: tuple[Path, Any, list[list[int]]]) -> None:
    model_dir, hf, expected = granite
    prompts = token_prompts(0, PROMPT_LENGTHS)
    outs = greedy(make_llm(model_dir), prompts, logprobs=0)
    assert [list(c.token_ids) for c in outs] == expected
    for prompt, comp in zip(prompts, outs, strict=True):
        ours = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        ref = hf_token_logprobs(hf, prompt, list(comp.token_ids))
        assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-3


@pytest.mark.parametrize(
    "engine_kw",
    [
        {"max_num_batched_tokens": 24},
        {"max_num_seqs": 1},
        # 7 blocks of 16 cannot hold all four requests at once: preemption and recompute.
        {"num_gpu_blocks_override": 7, "max_model_len": 96},
        {"enforce_eager": False},  # the CPU platform's native layer kernels where they load
    ],
    ids=["chunk24", "one_seq", "preempt", "native"],
)
def test_schedules_match_hf(
    granite: tuple[Path, Any, list[list[int]]], engine_kw: dict[str, Any]
) -> None:
    model_dir, _, expected = granite
    llm = make_llm(model_dir, **engine_kw)
    assert token_ids(llm, token_prompts(0, PROMPT_LENGTHS)) == expected
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.get_stats().total_preemptions > 0


def test_prefix_caching_on_off_identical(granite: tuple[Path, Any, list[list[int]]]) -> None:
    model_dir, _, _ = granite
    prompts = token_prompts(2, [4, 13, 22, 9], prefix=token_prompts(1, [40])[0])
    expected = token_ids(make_llm(model_dir, enable_prefix_caching=False), prompts)
    on = make_llm(model_dir)
    assert token_ids(on, prompts) == expected  # shared prefix inside one batch
    before = on.get_stats()
    assert token_ids(on, prompts[::-1]) == expected[::-1]  # across batches: snapshot hits
    # A hybrid's prefix hit needs the state snapshot too: every prompt resumes from one, after
    # at least the shared prefix's two full blocks.
    after = on.get_stats()
    assert after.state_hits - before.state_hits == len(prompts)
    assert after.prefix_hits - before.prefix_hits >= len(prompts) * 32
    on.reset_prefix_cache()
    assert on.get_stats().state_snapshots_cached == 0
    assert token_ids(on, prompts[:2]) == expected[:2]


def test_restored_snapshot_continues_like_hf_cache(
    granite: tuple[Path, Any, list[list[int]]],
) -> None:
    """A prompt extending an earlier one resumes from that prompt's state snapshot after its
    third block (48 tokens) and matches HF continuing its own cache from token 48."""
    model_dir, hf, _ = granite
    first = token_prompts(3, [50])[0]
    extended = first + token_prompts(4, [21])[0]
    llm = make_llm(model_dir)
    token_ids(llm, [first])
    before = llm.get_stats().prefix_hits
    assert token_ids(llm, [extended]) == [hf_greedy(hf, extended, MAX_TOKENS, split=48)]
    assert llm.get_stats().prefix_hits - before == 48


def test_default_max_num_seqs_capped_to_state_budget(
    granite: tuple[Path, Any, list[list[int]]],
) -> None:
    """Left at its default, max_num_seqs shrinks to the running state slots a quarter of the
    budget holds (as granite-4.0-h-350m needs on CPU: 22 MiB of state per request); asked
    for explicitly, too many is an error naming both knobs."""
    model_dir, _, expected = granite
    probe = make_llm(model_dir, max_model_len=96)
    per_slot = sum(layer.state_bytes() for layer in probe.engine.runner.recurrent_layers)
    budget = 10 * per_slot  # a quarter holds 2 running slots
    llm = make_llm(model_dir, max_model_len=96, kv_cache_memory_bytes=budget)
    assert llm.engine.config.scheduler.max_num_seqs == 2
    # Four requests through two slots, still HF's tokens.
    assert token_ids(llm, token_prompts(0, PROMPT_LENGTHS)) == expected
    with pytest.raises(ValueError, match=r"max_num_seqs=16 .*kv_cache_memory_bytes"):
        make_llm(model_dir, max_model_len=96, kv_cache_memory_bytes=budget, max_num_seqs=16)


def test_mamba_ssm_cache_dtype_sets_the_ssm_state_dtype(
    granite: tuple[Path, Any, list[list[int]]],
) -> None:
    model_dir, _, expected = granite
    mixers = make_llm(model_dir).engine.runner.recurrent_layers
    half = make_llm(model_dir, mamba_ssm_cache_dtype="bfloat16")
    half_mixers = half.engine.runner.recurrent_layers
    # The SSM state in bf16; the conv window stays in the model dtype (float32 here).
    assert [t.dtype for t in half_mixers[0].states] == [torch.float32, torch.bfloat16]
    assert [t.dtype for t in mixers[0].states] == [torch.float32, torch.float32]
    conv_bytes, ssm_bytes = (s.nbytes for s in mixers[0].state_shapes())
    assert half_mixers[0].state_bytes() == conv_bytes + ssm_bytes // 2
    # Short prompts' greedy tokens survive the rounding of a tiny model's state.
    assert token_ids(half, token_prompts(0, PROMPT_LENGTHS[:2])) == expected[:2]
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype must be one of auto, float32"):
        make_llm(model_dir, mamba_ssm_cache_dtype="fp8")


def test_unknown_layer_type_fails_at_load(
    granite: tuple[Path, Any, list[list[int]]], tmp_path: Path
) -> None:
    model_dir, _, _ = granite
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in model_dir.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    # transformers accepts "sliding_attention" as a layer type; Granite 4.0-H has none.
    config["layer_types"][1] = "sliding_attention"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'sliding_attention'.*mamba"):
        make_llm(bad)
