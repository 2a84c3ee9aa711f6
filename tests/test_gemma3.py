"""Gemma 3 text models against HF transformers on a tiny random checkpoint: sliding layers
(window 6, shorter than the prompts) alternating with full ones, two rope bases, (1 + w)
sandwich norms, embedding scale, query_pre_attn_scalar, GeLU-tanh and final soft-capping;
through the torch backend, the native CPU kernels and the one-call decode program."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures import build_tiny_checkpoint, pin_program_route
from test_models import (
    PROMPT_LENS,
    TOLERANCE,
    check_chunked_schedule,
    hf_logprobs,
    load_ours,
    make_sequences,
    max_diff,
    run_step,
)
from transformers import AutoModelForCausalLM

from tinyvllm import LLM, SamplingParams
from tinyvllm.native.build import unsupported_reason

NATIVE = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), tokenizer_dir)


def test_layer_layout(gemma_dir: Path) -> None:
    model, _ = load_ours(gemma_dir)
    layers = model.attention_layers()
    assert [layer.sliding_window for layer in layers] == [6, None, 6, None]
    assert [layer.scale for layer in layers] == [pytest.approx(24**-0.5)] * 4
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ropes = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert ropes[0] is ropes[2] is model.model.rotary_local
    assert ropes[1] is ropes[3] is model.model.rotary_emb
    # The parameter holds 1 + w: an unchanged checkpoint norm weight of 0 would be identity.
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32)
    want = hf.model.layers[1].post_feedforward_layernorm.weight + 1
    assert torch.equal(model.model.layers[1].post_feedforward_layernorm.weight, want)


def test_unsupported_configs_are_named(gemma_dir: Path) -> None:
    from transformers import AutoConfig

    from tinyvllm.models.gemma3 import Gemma3ForCausalLM

    config = AutoConfig.from_pretrained(gemma_dir)
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        Gemma3ForCausalLM(config, 64)
    config = AutoConfig.from_pretrained(gemma_dir)
    config.hidden_activation = "relu"
    with pytest.raises(ValueError, match="hidden_activation='relu'"):
        Gemma3ForCausalLM(config, 64)


def test_prefill_matches_transformers(gemma_dir: Path) -> None:
    model, backend = load_ours(gemma_dir)
    prompts = make_sequences(model.config.vocab_size, PROMPT_LENS)
    expected = hf_logprobs(gemma_dir, prompts)
    ours = run_step(model, backend, prompts, [0, 0, 0], PROMPT_LENS)
    for got, want in zip(ours, expected, strict=True):
        assert max_diff(got, want) < TOLERANCE
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_chunked_prefill_and_decode_match_transformers(gemma_dir: Path) -> None:
    check_chunked_schedule(gemma_dir)


def test_bfloat16_close_to_transformers(gemma_dir: Path) -> None:
    model, backend = load_ours(gemma_dir, dtype=torch.bfloat16)
    prompts = make_sequences(model.config.vocab_size, PROMPT_LENS)
    expected = hf_logprobs(gemma_dir, prompts, dtype=torch.bfloat16)
    ours = run_step(model, backend, prompts, [0, 0, 0], PROMPT_LENS)
    for got, want in zip(ours, expected, strict=True):
        top = want.argmax(-1, keepdim=True)
        assert max_diff(got.gather(-1, top), want.gather(-1, top)) < 0.5
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def _hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@NATIVE
@pytest.mark.usefixtures("one_torch_thread")
def test_engine_greedy_matches_transformers(gemma_dir: Path) -> None:
    """Batched generation through the engine (native attention and the decode program),
    with a shared prefix served from the prefix cache and prompts chunked by a small token
    budget: HF's greedy continuation token for token."""
    max_tokens = 10
    base = make_sequences(2000, (9, 21, 30), seed=5)
    prompts = [*base, base[2][:16] + base[0]]  # the last one reuses a cached block of base[2]
    expected = _hf_greedy(gemma_dir, prompts, max_tokens)
    llm = LLM(
        str(gemma_dir),
        dtype="float32",
        max_model_len=128,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
    )
    assert llm.engine.runner.decode_program is not None
    assert _greedy(llm, prompts[:3], max_tokens) == expected[:3]
    assert _greedy(llm, prompts, max_tokens) == expected
    assert llm.get_stats().prefix_hits > 0
    eager = LLM(str(gemma_dir), dtype="float32", max_model_len=128, enforce_eager=True)
    assert _greedy(eager, prompts, max_tokens) == expected


@NATIVE
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_program_is_bit_identical_to_native_layers(gemma_dir: Path, dtype: str) -> None:
    llm = LLM(str(gemma_dir), dtype=dtype, max_model_len=128)
    prompts = make_sequences(2000, (3, 12, 25), seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run() -> list[tuple[list[int], list[dict[int, float]]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            (
                list(o.outputs[0].token_ids),
                [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
            )
            for o in outs
        ]

    assert llm.engine.runner.decode_program is not None
    pin_program_route(llm)
    with_program = run()
    llm.engine.runner.decode_program = None
    llm.reset_prefix_cache()
    assert run() == with_program


# --- GGUF --------------------------------------------------------------------------------


def _gguf_ready_checkpoint(root: Path, tokenizer_dir: Path, **overrides: object) -> Path:
    """A tiny Gemma 3 with what a GGUF file can say: llama.cpp's period-6 layer pattern and
    a query scale of head_dim."""
    kwargs: dict[str, object] = {
        "num_hidden_layers": 7,
        "layer_types": None,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 16,
        **overrides,
    }
    return build_tiny_checkpoint("gemma3", root, tokenizer_dir, **kwargs)


def test_f32_gguf_loads_the_checkpoint_exactly(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Gemma names, the +1 llama.cpp folds into every norm, the layer pattern, both rope
    bases (global with linear scaling) and the soft-cap all come back from the file."""
    import gguf
    from gguf_writer import write_tiny_gguf
    from transformers import AutoConfig

    from tinyvllm.gguf.config import load_gguf_config
    from tinyvllm.models.loader import load_model

    model_dir = _gguf_ready_checkpoint(tmp_path / "ckpt", tokenizer_dir)
    softcap = {"{arch}.final_logit_softcapping": (30.0, gguf.GGUFValueType.FLOAT32)}
    path = write_tiny_gguf(model_dir, tmp_path / "g.gguf", metadata=softcap)
    config, reference = load_gguf_config(path), AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.layer_types == reference.layer_types
    assert config.layer_types[4:] == ["sliding_attention", "full_attention", "sliding_attention"]
    for key in ("rope_parameters", "sliding_window", "query_pre_attn_scalar", "head_dim"):
        assert getattr(config, key) == getattr(reference, key), key
    assert config.final_logit_softcapping == reference.final_logit_softcapping == 30.0
    ours = load_model(path, config, torch.float32, "cpu", 128).state_dict()
    ref = load_model(model_dir, reference, torch.float32, "cpu", 128).state_dict()
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


@NATIVE
@pytest.mark.usefixtures("one_torch_thread")
def test_quantized_gguf_matches_transformers_gguf_loader(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Greedy tokens and logprobs against transformers loading the same Q5_0 / Q4_0 / Q8_0
    file (q/k/v of mixed types, as llama.cpp's Q4_K_M writes them), through the native decode
    program on the file's blocks. transformers reads no rope scaling, soft-cap or query scale
    from GGUF (it assumes 256), so the checkpoint has none and head_dim 256."""
    from gguf import GGMLQuantizationType as Q
    from gguf_writer import write_tiny_gguf

    from tinyvllm.parity import load_hf_reference, run_parity

    model_dir = _gguf_ready_checkpoint(
        tmp_path / "ckpt",
        tokenizer_dir,
        head_dim=256,
        query_pre_attn_scalar=256,
        final_logit_softcapping=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )

    def mixed(name: str, weight: object) -> Q:
        kind = name.split(".")[-2]
        return {"attn_q": Q.Q5_0, "attn_k": Q.Q4_0, "ffn_gate": Q.Q5_0}.get(kind, Q.Q8_0)

    path = write_tiny_gguf(model_dir, tmp_path / "tiny.gguf", qtype_for=mixed)
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    assert llm.engine.runner.decode_program is not None
    prompts = make_sequences(2000, (7, 20), seed=8)
    report = run_parity(llm, load_hf_reference(str(path)), prompts, 12)
    assert report.identical, report.summary()
    assert report.max_logprob_diff < 1e-3, report.summary()


_TRITON_PARITY = """
import sys
from tinyvllm import LLM
from tinyvllm.parity import load_hf_reference, run_parity
path = sys.argv[1]
llm = LLM(path, dtype="float32", attention_backend="triton", enforce_eager=True,
          max_model_len=128, max_num_batched_tokens=16)
assert llm.engine.runner.backend.name == "triton"
prompts = [[11, 12, 13] * 7, [40] * 33, list(range(5, 30))]
report = run_parity(llm, load_hf_reference(path), prompts, 8)
assert report.identical and report.max_logprob_diff < 1e-3, report.summary()
"""


@pytest.mark.slow
def test_triton_backend_in_the_interpreter_matches_transformers(gemma_dir: Path) -> None:
    """The Triton attention kernels (run by Triton's CPU interpreter) with Gemma's per-layer
    windows, chunked by a 16-token budget: HF's greedy tokens and logprobs."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-c", _TRITON_PARITY, str(gemma_dir)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_gguf_layer_pattern_from_metadata(tmp_path: Path, tokenizer_dir: Path) -> None:
    """`attention.sliding_window_pattern` as a period or as per-layer flags (bools or ints,
    as converters write them) overrides llama.cpp's period of 6; a bad one is named."""
    import gguf
    from gguf_writer import write_tiny_gguf

    from tinyvllm.gguf.config import load_gguf_config

    model_dir = _gguf_ready_checkpoint(tmp_path / "ckpt", tokenizer_dir)
    key = "{arch}.attention.sliding_window_pattern"
    A, U32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    flags = [True, False, True, True, False, True, False]
    from_flags = ["sliding_attention" if f else "full_attention" for f in flags]
    cases = [
        ((2, U32), ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"]),
        ((flags, A), from_flags),
        (([int(f) for f in flags], A), from_flags),
    ]
    for i, (value, want) in enumerate(cases):
        path = write_tiny_gguf(model_dir, tmp_path / f"p{i}.gguf", metadata={key: value})
        assert load_gguf_config(path).layer_types == want
    bad = write_tiny_gguf(model_dir, tmp_path / "bad.gguf", metadata={key: ([1, 2], A)})
    with pytest.raises(ValueError, match=r"gemma3\.attention\.sliding_window_pattern must be 7"):
        load_gguf_config(bad)
