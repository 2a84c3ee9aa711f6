"""Gemma 3 vision-language model against HF transformers on a tiny random checkpoint: image
spans attended bidirectionally (sliding window smaller and larger than the span), text and
image requests batched, chunked prefill under a budget smaller than a span, prefix caching
with the same and another image, image preprocessing against transformers, and bad input."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gemma3_vlm_fixtures import (
    IMAGE_PROMPT,
    IMAGE_SIZE,
    build_tiny_gemma3_vlm,
    hf_model,
    random_image,
)
from PIL import Image

from tinyvllm import LLM, SamplingParams
from tinyvllm.multimodal.gemma3_processing import Gemma3ImageConfig, process_image

IMAGES = [random_image(40, 50, seed=1), random_image(32, 32, seed=2)]
TWO_IMAGES = "A <start_of_image> and B <start_of_image> compare"


@pytest.fixture(scope="module", params=[2, 9], ids=["window2", "window9"])
def vlm_dir(request: Any, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp(f"gemma3_vlm_{request.param}")
    return build_tiny_gemma3_vlm(out, tokenizer_dir, sliding_window=request.param)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True,
               "kv_cache_memory_bytes": 2**22, "seed": 0}  # fmt: skip
    return LLM(str(path), **(options | kwargs))


def params(prompt_logprobs: int | None = 0) -> SamplingParams:
    return SamplingParams(
        max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=prompt_logprobs
    )


def hf_pixels(images: list[np.ndarray]) -> torch.Tensor:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return proc([Image.fromarray(i) for i in images], return_tensors="pt")["pixel_values"]


@torch.no_grad()
def hf_reference(hf: Any, ids: list[int], images: list[np.ndarray]) -> tuple[list[int], Any]:
    """Greedy tokens and the prompt's per-position log-softmax, with token_type_ids."""
    t = torch.tensor([ids])
    kwargs: dict[str, Any] = {"token_type_ids": (t == hf.config.image_token_id).long()}
    if images:
        kwargs["pixel_values"] = hf_pixels(images)
    logits = hf(input_ids=t, **kwargs).logits[0].float().log_softmax(-1)
    out = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=4,
                      do_sample=False, **kwargs)  # fmt: skip
    return out[0, len(ids) :].tolist(), logits


def check_against_hf(hf: Any, output: Any, images: list[np.ndarray]) -> None:
    ids = output.prompt_token_ids
    prompt_lps = [output.prompt_logprobs[pos][ids[pos]].logprob for pos in range(1, len(ids))]
    check_ids_against_hf(hf, ids, list(output.outputs[0].token_ids), prompt_lps, images)


def check_ids_against_hf(
    hf: Any, ids: list[int], tokens: list[int], prompt_lps: list[float], images: list[np.ndarray]
) -> None:
    """Greedy tokens identical, every prompt position's logprob (image spans included)
    within 1e-3."""
    want, logp = hf_reference(hf, ids, images)
    assert tokens == want
    for pos in range(1, len(ids)):
        assert abs(prompt_lps[pos - 1] - float(logp[pos - 1, ids[pos]])) < 1e-3, pos


@pytest.mark.parametrize("eager", [True, False], ids=["torch", "native"])
def test_matches_hf_and_batches_text(vlm_dir: Path, eager: bool) -> None:
    """Through the torch backend, and (not eager) the native CPU backend and decode program:
    image steps run the torch plan, text decodes the native program."""
    hf = hf_model(vlm_dir)
    llm = make_llm(vlm_dir, enforce_eager=eager)
    prompts = [
        {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
        "Plain text only here",
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
    ]
    outs = llm.generate(prompts, params())
    n = hf.config.mm_tokens_per_image
    assert outs[0].prompt_token_ids.count(hf.config.image_token_id) == n
    check_against_hf(hf, outs[0], IMAGES[:1])
    check_against_hf(hf, outs[1], [])
    check_against_hf(hf, outs[2], IMAGES)
    # The span is really bidirectional: HF without token_type_ids (causal) differs.
    ids = torch.tensor([outs[0].prompt_token_ids])
    with torch.no_grad():
        causal = hf(input_ids=ids, pixel_values=hf_pixels(IMAGES[:1])).logits[0].log_softmax(-1)
    last = len(outs[0].prompt_token_ids) - 1
    ours = outs[0].prompt_logprobs[last][ids[0, last].item()].logprob
    assert abs(ours - float(causal[last - 1, ids[0, last]])) > 1e-3


def test_chunked_prefill_never_splits_a_span(vlm_dir: Path) -> None:
    hf = hf_model(vlm_dir)
    # A budget of 6 tokens: smaller than the prompt, larger than a span (4 tokens).
    llm = make_llm(vlm_dir, max_num_batched_tokens=6, max_num_seqs=2)
    prompt = {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}}
    outs = llm.generate([prompt, "Some text alongside it"], params())
    check_against_hf(hf, outs[0], IMAGES)
    check_against_hf(hf, outs[1], [])
    small = make_llm(vlm_dir, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="max_num_batched_tokens=3"):
        small.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": IMAGES[0]}})


def test_prefix_cache_same_and_other_image(vlm_dir: Path) -> None:
    hf = hf_model(vlm_dir)
    llm = make_llm(vlm_dir, enable_prefix_caching=True, block_size=4)
    text = "One two three four five six <start_of_image> what is it"
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[0]}}, params(None))
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[0]}}, params(None))
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[1]}}, params(None))
    assert again[0].num_cached_tokens > 0
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    ids = first[0].prompt_token_ids
    span_start = ids.index(hf.config.image_token_id)
    # The other image shares the text before it only, and a hit never ends inside a span.
    assert other[0].num_cached_tokens <= span_start
    assert other[0].outputs[0].token_ids == hf_reference(hf, ids, IMAGES[1:])[0]


def test_image_preprocessing_matches_transformers() -> None:
    cfg = Gemma3ImageConfig(size=IMAGE_SIZE)
    for shape, seed in (((50, 70, 3), 0), ((17, 9, 3), 1), ((32, 32, 3), 2)):
        image = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
        ours = process_image(image, cfg, "image")
        assert np.array_equal(ours, hf_pixels([image])[0].numpy())


def test_bad_input(vlm_dir: Path, tiny_model_dir_gemma: Path) -> None:
    llm = make_llm(vlm_dir)
    with pytest.raises(ValueError, match=r"could not decode image"):
        llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": b"not an image"}})
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\).*2 image\(s\)"):
        llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": IMAGES}})
    with pytest.raises(ValueError, match="'image' only"):
        llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"video": IMAGES[0]}})
    png = io.BytesIO()
    Image.fromarray(IMAGES[0]).save(png, format="PNG")
    outs = llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": png.getvalue()}})
    assert outs[0].outputs[0].token_ids
    text_only = make_llm(tiny_model_dir_gemma)
    with pytest.raises(ValueError, match="text-only"):
        text_only.generate({"prompt": "hi", "multi_modal_data": {"image": IMAGES[0]}})


@pytest.fixture(scope="module")
def tiny_model_dir_gemma(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from fixtures import build_tiny_checkpoint

    return build_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3_text"), tokenizer_dir)


def test_chat_content_parts(vlm_dir: Path) -> None:
    llm = make_llm(vlm_dir)
    template = (
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
        "<end_of_turn>\n{% endfor %}<start_of_turn>model"
    )
    parts = [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "What is it?"}]
    chat = llm.chat([{"role": "user", "content": parts}], params(None), chat_template=template)
    text = "<start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n<start_of_turn>model"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)  # as chat() encodes
    direct = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGES[0]}}, params(None)
    )
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


_TRITON_RUN = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from gemma3_vlm_fixtures import random_image
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", attention_backend="triton", enforce_eager=True,
          max_model_len=256, max_num_batched_tokens=8, kv_cache_memory_bytes=2**22)
assert llm.engine.runner.backend.name == "triton"
images = [random_image(40, 50, seed=1), random_image(32, 32, seed=2)]
prompt = {"prompt": sys.argv[3], "multi_modal_data": {"image": images}}
params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0)
out = llm.generate([prompt, "Plain text only here"], params)
rows = []
for o in out:
    ids = o.prompt_token_ids
    lps = [o.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    rows.append([ids, list(o.outputs[0].token_ids), lps])
print("RESULT" + json.dumps(rows))
"""


@pytest.mark.slow
def test_triton_backend_in_the_interpreter(vlm_dir: Path) -> None:
    """The Triton kernel's bidirectional spans with per-layer windows (Triton's CPU
    interpreter), chunked by an 8-token budget, against HF."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = str(Path(__file__).parent)
    cmd = [sys.executable, "-c", _TRITON_RUN, str(vlm_dir), here, TWO_IMAGES]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(result.stdout.split("RESULT", 1)[1])
    hf = hf_model(vlm_dir)
    for (ids, tokens, lps), images in zip(rows, [IMAGES, []], strict=True):
        check_ids_against_hf(hf, ids, tokens, lps, images)


def test_cli_generate_with_image(vlm_dir: Path, tmp_path: Path, capsys: Any) -> None:
    """`--image` puts the model's own placeholder (<start_of_image>) before the prompt."""
    from tinyvllm.cli import main

    png = tmp_path / "picture.png"
    Image.fromarray(IMAGES[0]).save(png)
    argv = ["generate", "-m", str(vlm_dir), "--dtype", "float32", "--max-model-len", "256"]
    assert main([*argv, "--max-tokens", "4", "--image", str(png), " describe it"]) == 0
    printed = capsys.readouterr().out.strip()
    llm = make_llm(vlm_dir)
    prompt = {"prompt": "<start_of_image> describe it", "multi_modal_data": {"image": IMAGES[0]}}
    ref = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    assert printed == ref[0].outputs[0].text.strip()


def test_expanded_prompt_ids_and_pan_and_scan(vlm_dir: Path, tmp_path: Path) -> None:
    """Token ids already expanded (as the engine returns them) are kept as they are; a
    checkpoint asking for pan and scan is refused with the fix."""
    import json
    import shutil

    llm = make_llm(vlm_dir)
    image = {"image": IMAGES[0]}
    first = llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": image}, params())
    ids = first[0].prompt_token_ids
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": image}, params())
    assert again[0].prompt_token_ids == ids
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    eoi = ids.index(llm.engine.mm_processor.eoi)
    cut = ids[: eoi - 1] + ids[eoi:]  # one image token fewer
    with pytest.raises(ValueError, match="image 0 has 3 image tokens"):
        llm.generate({"prompt_token_ids": cut, "multi_modal_data": image})
    copy = Path(shutil.copytree(vlm_dir, tmp_path / "pan_and_scan"))
    config = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps(config | {"do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="do_pan_and_scan=true is not supported"):
        make_llm(copy)


def test_preemption_matches_hf(vlm_dir: Path) -> None:
    """Requests preempted and recomputed (their images re-encoded or taken from the encoder
    cache) give HF's tokens."""
    hf = hf_model(vlm_dir)
    llm = make_llm(vlm_dir, num_gpu_blocks_override=12, block_size=4, max_model_len=40)
    many = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = [
        {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
        {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": IMAGES[1]}},
    ]
    outs = llm.generate(prompts, many, use_tqdm=False)
    assert llm.get_stats().total_preemptions > 0
    for out, images in zip(outs, [IMAGES[:1], IMAGES, IMAGES[1:]], strict=True):
        t = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = hf.generate(
                input_ids=t, attention_mask=torch.ones_like(t), pixel_values=hf_pixels(images),
                token_type_ids=(t == hf.config.image_token_id).long(), max_new_tokens=16,
                do_sample=False,
            )  # fmt: skip
        assert out.outputs[0].token_ids == want[0, t.shape[1] :].tolist()
