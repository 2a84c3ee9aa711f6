"""Qwen2.5-VL end to end against HF transformers on a tiny random checkpoint: image and video
prompts, batches mixing text and media, chunked prefill splitting the media, preemption, EVS
against an oracle built from HF parts, prefix caching with media, and bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vlm_fixtures import (
    IMAGE_PROMPT,
    VIDEO_PROMPT,
    build_tiny_vlm,
    hf_model,
    moving_clip,
    random_image,
)

from tinyvllm import LLM, SamplingParams
from tinyvllm.multimodal.qwen_vl_processing import (
    QwenVLProcessorConfig,
    process_images,
    process_video,
)

MAX_TOKENS = 6
# 8 frames of 56 x 196: a (4, 2, 7) merged grid. Its time positions (0, 2, 4, 6 with
# tokens_per_second=2) stay below its width, so the text after it starts at the same place
# under transformers' and vLLM's rules for where text continues after a video.
CLIP = moving_clip(8, 56, 196, seed=3)
IMAGE = random_image(56, 84, seed=1)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"), tokenizer_dir)


@pytest.fixture(scope="module")
def hf(vlm_dir: Path) -> Any:
    return hf_model(vlm_dir)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 512,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 2**24,
        "seed": 0,
    }
    return LLM(str(path), **(options | kwargs))


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=0)


def hf_media(hf: Any, ids: torch.Tensor, images: list, videos: list) -> dict[str, Any]:
    cfg = QwenVLProcessorConfig()
    kwargs: dict[str, Any] = {}
    if images:
        pv, grid = process_images(images, cfg)
        kwargs |= {"pixel_values": torch.from_numpy(pv), "image_grid_thw": torch.from_numpy(grid)}
    if videos:
        pvs, grids = zip(*(process_video(v, cfg) for v in videos), strict=True)
        kwargs |= {
            "pixel_values_videos": torch.from_numpy(np.concatenate(pvs)),
            "video_grid_thw": torch.from_numpy(np.concatenate(grids)),
        }
    types = (ids == hf.config.image_token_id).int() + 2 * (ids == hf.config.video_token_id).int()
    return kwargs | {"mm_token_type_ids": types}


@torch.no_grad()
def hf_reference(
    hf: Any, prompt_ids: list[int], images: list = (), videos: list = ()
) -> tuple[list[int], list[float]]:
    """HF greedy tokens and their logprobs (one full forward over prompt + output)."""
    ids = torch.tensor([prompt_ids])
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        **hf_media(hf, ids, list(images), list(videos)),
    )
    tokens = out[0, len(prompt_ids) :].tolist()
    logits = hf(input_ids=out, **hf_media(hf, out, list(images), list(videos))).logits[0]
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1].float(), dim=-1)
    return tokens, logp.gather(1, torch.tensor(tokens)[:, None]).flatten().tolist()


def assert_matches(output: Any, tokens: list[int], logprobs: list[float]) -> None:
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    ours = [lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True)]
    assert np.allclose(ours, logprobs, atol=1e-3), (ours, logprobs)


def image_request(image: np.ndarray = IMAGE) -> dict[str, Any]:
    return {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": image}}


def video_request(clip: np.ndarray = CLIP) -> dict[str, Any]:
    return {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": clip}}


def test_image_prompt_matches_hf(vlm_dir: Path, hf: Any) -> None:
    llm = make_llm(vlm_dir)
    out = llm.generate(image_request(), greedy())[0]
    assert len(out.prompt_token_ids) > len(llm.get_tokenizer().encode(IMAGE_PROMPT))
    assert_matches(out, *hf_reference(hf, out.prompt_token_ids, images=[IMAGE]))


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_video_prompt_matches_hf(vlm_dir: Path, hf: Any, enforce_eager: bool) -> None:
    """Also with the CPU platform's native ops (the decode program and CUDA graphs stay off:
    they take flat positions)."""
    llm = make_llm(vlm_dir, enforce_eager=enforce_eager)
    assert llm.engine.runner.decode_program is None
    out = llm.generate(video_request(), greedy())[0]
    assert out.prompt_token_ids.count(hf.config.video_token_id) == 4 * 2 * 7
    assert_matches(out, *hf_reference(hf, out.prompt_token_ids, videos=[CLIP]))


def test_token_id_prompt_with_one_placeholder(vlm_dir: Path, hf: Any) -> None:
    llm = make_llm(vlm_dir)
    ids = llm.get_tokenizer().encode(IMAGE_PROMPT)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGE}}, greedy())
    assert_matches(out[0], *hf_reference(hf, out[0].prompt_token_ids, images=[IMAGE]))


@pytest.mark.parametrize("budget", [None, 7])
def test_batch_of_text_image_video_matches_hf(vlm_dir: Path, hf: Any, budget: int | None) -> None:
    """One batch mixing all three; with a 7-token budget every media span is split across
    steps, and each item is still encoded once."""
    llm = make_llm(vlm_dir, max_num_batched_tokens=budget)
    second = random_image(84, 56, seed=2)
    prompts = [
        video_request(),
        "plain text between the media",
        image_request(),
        {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": [second]}},
    ]
    model = llm.engine.runner.model
    calls: list[int] = []
    encode = model.embed_media

    def counting(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        calls.append(len(grid))
        return encode(pixels, grid)

    model.embed_media = counting
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    state = llm.engine.runner.model_state
    assert state.num_encoded == 3 == sum(calls)
    if budget is None:  # all in the first step: one encoder call for the three items
        assert calls == [3]
    assert state.encoder_cache == {}  # every entry freed once its tokens were computed
    assert_matches(outs[0], *hf_reference(hf, outs[0].prompt_token_ids, videos=[CLIP]))
    assert_matches(outs[1], *hf_reference(hf, outs[1].prompt_token_ids))
    assert_matches(outs[2], *hf_reference(hf, outs[2].prompt_token_ids, images=[IMAGE]))
    assert_matches(outs[3], *hf_reference(hf, outs[3].prompt_token_ids, images=[second]))


def test_preemption_matches_hf(vlm_dir: Path, hf: Any) -> None:
    llm = make_llm(vlm_dir, num_gpu_blocks_override=12, block_size=8, max_model_len=96)
    prompts = [video_request(), image_request(), video_request(CLIP[::-1].copy())]
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert llm.get_stats().total_preemptions > 0
    for out, media in zip(outs, ([CLIP], [IMAGE], [CLIP[::-1].copy()]), strict=True):
        key = "images" if media[0].ndim == 3 else "videos"
        tokens, _ = _hf_tokens(hf, out.prompt_token_ids, 12, **{key: media})
        assert out.outputs[0].token_ids == tokens


@torch.no_grad()
def _hf_tokens(hf: Any, prompt_ids: list[int], n: int, **media: list) -> tuple[list[int], None]:
    ids = torch.tensor([prompt_ids])
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        **hf_media(hf, ids, media.get("images", []), media.get("videos", [])),
    )
    return out[0, len(prompt_ids) :].tolist(), None


def test_prefix_cache_keys_on_media_content(vlm_dir: Path) -> None:
    """The same video twice hits the prefix cache; one changed pixel misses from the video on
    (placeholder tokens are identical, only the content hash tells them apart)."""
    llm = make_llm(vlm_dir, block_size=8)
    first = llm.generate(video_request(), greedy(), use_tqdm=False)[0]
    again = llm.generate(video_request(), greedy(), use_tqdm=False)[0]
    changed = CLIP.copy()
    changed[5, 30, 100, 0] ^= 1
    other = llm.generate(video_request(changed), greedy(), use_tqdm=False)[0]
    video_start = first.prompt_token_ids.index(llm.engine.config.model.hf_config.video_token_id)
    assert again.num_cached_tokens >= video_start + 4 * 2 * 7 - 8
    assert other.num_cached_tokens == video_start // 8 * 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


# ---- EVS ------------------------------------------------------------------------------


def retention_mask(embeds: torch.Tensor, grid: tuple[int, int, int], rate: float) -> torch.Tensor:
    """The rule as the issue states it (written here again, independently of the engine)."""
    t, h, w = grid
    frames = embeds.reshape(t, h, w, -1)
    scores = 1 - torch.nn.functional.cosine_similarity(frames[1:], frames[:-1], dim=-1)
    scores = torch.cat([torch.full((1, h, w), 1e9), scores]).flatten()
    k = max(h * w, int(t * h * w * (1 - rate)))
    mask = torch.zeros(t * h * w, dtype=torch.bool)
    mask[torch.argsort(scores, descending=True, stable=True)[:k]] = True
    return mask


@torch.no_grad()
def evs_oracle(
    hf: Any, prompt: str, clip: np.ndarray, rate: float, tokenizer: Any
) -> tuple[list[int], torch.Tensor]:
    """HF vision features -> retention rule -> HF language model on the kept embeddings with
    explicit M-RoPE positions (kept tokens at their original (t, h, w))."""
    pv, grid = process_video(clip, QwenVLProcessorConfig())
    feats = hf.model.get_video_features(torch.from_numpy(pv), torch.from_numpy(grid))
    feats = feats.pooler_output[0]
    t, h, w = int(grid[0, 0]), int(grid[0, 1]) // 2, int(grid[0, 2]) // 2
    mask = retention_mask(feats, (t, h, w), rate)
    before, after = prompt.split("<|video_pad|>")
    head, tail = tokenizer.encode(before), tokenizer.encode(after)
    pad = hf.config.video_token_id
    ids = torch.tensor(head + [pad] * int(mask.sum()) + tail)
    tt, hh, ww = torch.meshgrid(
        torch.arange(t) * 2, torch.arange(h), torch.arange(w), indexing="ij"
    )
    grid_pos = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + len(head)
    after_start = int(grid_pos.max()) + 1
    positions = torch.cat(
        [
            torch.arange(len(head)).expand(3, -1),
            grid_pos[:, mask],
            (torch.arange(len(tail)) + after_start).expand(3, -1),
        ],
        dim=1,
    )
    embeds = hf.model.get_input_embeddings()(ids)
    embeds[len(head) : len(head) + int(mask.sum())] = feats[mask]
    tokens: list[int] = []
    next_pos = after_start + len(tail)
    for _ in range(MAX_TOKENS):
        hidden = hf.model.language_model(
            inputs_embeds=embeds[None], position_ids=positions[:, None, :]
        ).last_hidden_state
        token = int(hf.lm_head(hidden[0, -1]).argmax())
        tokens.append(token)
        embeds = torch.cat([embeds, hf.model.get_input_embeddings()(torch.tensor([token]))])
        positions = torch.cat([positions, torch.full((3, 1), next_pos)], dim=1)
        next_pos += 1
    return tokens, mask


@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75])
def test_evs_matches_oracle(vlm_dir: Path, hf: Any, rate: float) -> None:
    llm = make_llm(vlm_dir, video_pruning_rate=rate, max_num_batched_tokens=9)
    out = llm.generate(video_request(), greedy(), use_tqdm=False)[0]
    kept = out.prompt_token_ids.count(hf.config.video_token_id)
    assert kept == max(14, int(56 * (1 - rate)))
    expected, _ = evs_oracle(hf, VIDEO_PROMPT, CLIP, rate, llm.get_tokenizer())
    assert out.outputs[0].token_ids == expected


def test_evs_static_clip_keeps_first_frame(vlm_dir: Path, hf: Any) -> None:
    """Frames 2..T copy frame 1: only frame 1's tokens survive (the minimum count)."""
    static = np.repeat(CLIP[:1], 8, axis=0)
    llm = make_llm(vlm_dir, video_pruning_rate=0.75)
    out = llm.generate(video_request(static), greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(hf.config.video_token_id) == 14
    expected, mask = evs_oracle(hf, VIDEO_PROMPT, static, 0.75, llm.get_tokenizer())
    assert mask[:14].all() and not mask[14:].any()
    assert out.outputs[0].token_ids == expected


def test_evs_rate_zero_is_no_evs(vlm_dir: Path) -> None:
    plain = make_llm(vlm_dir).generate(video_request(), greedy(), use_tqdm=False)[0]
    zero = make_llm(vlm_dir, video_pruning_rate=0.0)
    out = zero.generate(video_request(), greedy(), use_tqdm=False)[0]
    assert type(zero.engine.runner.model_state).__name__ == "MRopeModelState"
    assert out.prompt_token_ids == plain.prompt_token_ids
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    # Same inputs, same model: only the summation order of a step's thread count may differ.
    assert _chosen_logprobs(out) == pytest.approx(_chosen_logprobs(plain), rel=1e-5, abs=1e-6)


def _chosen_logprobs(out: Any) -> list[float]:
    completion = out.outputs[0]
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    return [lp[t].logprob for lp, t in pairs]


# ---- bad input ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(vlm_dir: Path) -> Iterator[LLM]:
    yield make_llm(vlm_dir, max_model_len=128)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"image": np.zeros((56, 56), np.uint8)}, r"\(height, width, 3\) RGB array"),
        ({"image": np.zeros((56, 56, 3), np.float32)}, "dtype uint8"),
        ({"video": np.zeros((0, 56, 56, 3), np.uint8)}, "zero frames"),
        ({"video": np.zeros((4, 56, 56), np.uint8)}, r"\(num_frames, height, width, 3\)"),
        ({"image": [IMAGE, IMAGE]}, r"1 image placeholder\(s\).*gives 2 image"),
        ({"audio": IMAGE}, "cannot take audio"),
    ],
)
def test_bad_media_names_the_problem(vlm: LLM, data: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        vlm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": data}, use_tqdm=False)
    assert not vlm.engine.has_unfinished_requests()


def test_more_placeholders_than_items(vlm: LLM) -> None:
    prompt = IMAGE_PROMPT + " and <|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\).*gives 1 image"):
        vlm.generate({"prompt": prompt, "multi_modal_data": {"image": IMAGE}}, use_tqdm=False)
    with pytest.raises(ValueError, match="no multi_modal_data"):
        vlm.generate(IMAGE_PROMPT, use_tqdm=False)


def test_video_longer_than_context_says_how_many_frames_fit(
    vlm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 32 frames: 16 groups of 14 tokens = 224; 120 left beside the text = 8 groups.
    long_clip = np.repeat(CLIP, 4, axis=0)
    message = r"max_model_len=128; at this size 16 frames fit"
    with pytest.raises(ValueError, match=message):
        vlm.generate(video_request(long_clip), use_tqdm=False)
    # Frames as a list: known only once decoded, then the same check.
    with pytest.raises(ValueError, match=message):
        vlm.generate(video_request(list(long_clip)), use_tqdm=False)

    def no_preprocessing(*args: Any) -> None:
        raise AssertionError("an array's shape already tells it cannot fit")

    monkeypatch.setattr("tinyvllm.engine.mm_inputs.process_video", no_preprocessing)
    with pytest.raises(ValueError, match=message):
        vlm.generate(video_request(long_clip), use_tqdm=False)


def test_pruning_rate_outside_range(vlm_dir: Path) -> None:
    for rate in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"video_pruning_rate must be a number in \[0, 1\)"):
            make_llm(vlm_dir, video_pruning_rate=rate)


def test_image_to_text_only_model(tiny_models: Any) -> None:
    llm = LLM(str(tiny_models["qwen2"]), dtype="float32", max_model_len=128, enforce_eager=True)
    with pytest.raises(ValueError, match="text-only: it cannot take the image"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": IMAGE}}, use_tqdm=False)


# ---- chat ------------------------------------------------------------------------------


def test_chat_content_parts_match_generate(vlm_dir: Path, tmp_path: Path) -> None:
    """image_url with a file:// URL or a path, video as in-memory frames: the same tokens as
    generate() with the placeholders written out."""
    from PIL import Image

    llm = make_llm(vlm_dir)
    png = tmp_path / "picture.png"
    Image.fromarray(IMAGE).save(png)
    content = [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": png.as_uri()}},
        {"type": "text", "text": " with "},
        {"type": "video", "video": CLIP},
    ]
    chat = llm.chat([{"role": "user", "content": content}], greedy(), use_tqdm=False)[0]
    text = (
        "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|> with "
        "<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    data = {"image": [str(png)], "video": [CLIP]}
    ref = llm.generate({"prompt": text, "multi_modal_data": data}, greedy(), use_tqdm=False)[0]
    assert chat.prompt_token_ids == ref.prompt_token_ids
    assert chat.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="unknown content part type 'audio_url'"):
        llm.chat([{"role": "user", "content": [{"type": "audio_url"}]}], use_tqdm=False)


def test_chat_session_keeps_media_with_the_turn(vlm_dir: Path) -> None:
    import asyncio

    from tinyvllm.chat import ChatSession
    from tinyvllm.engine.async_llm import AsyncLLM

    llm = make_llm(vlm_dir)
    parts = [{"type": "image", "image": IMAGE}, {"type": "text", "text": "what is it"}]
    reference = llm.chat([{"role": "user", "content": parts}], greedy(), use_tqdm=False)[0]
    engine = AsyncLLM(llm.engine)
    try:
        session = ChatSession(engine, greedy())

        async def send(content: Any) -> str:
            return "".join([d async for d in session.send(content)])

        assert asyncio.run(send(parts)) == reference.outputs[0].text
        # The second turn's prompt still holds the first turn's image.
        asyncio.run(send("and again"))
        assert session.last_turn is not None
        assert session.last_turn.prompt_tokens > len(reference.prompt_token_ids)
        assert session.messages[0]["media"] == {"image": [IMAGE]}
    finally:
        engine.shutdown(timeout=30)


# ---- faces -----------------------------------------------------------------------------


def test_cli_generate_with_image(vlm_dir: Path, tmp_path: Path, capsys: Any) -> None:
    from PIL import Image

    from tinyvllm.cli import main

    png = tmp_path / "picture.png"
    Image.fromarray(IMAGE).save(png)
    argv = ["generate", "-m", str(vlm_dir), "--dtype", "float32", "--max-model-len", "256"]
    assert main([*argv, "--max-tokens", "6", "--image", str(png), " describe it"]) == 0
    printed = capsys.readouterr().out.strip()
    llm = make_llm(vlm_dir, max_model_len=256)
    prompt = "<|vision_start|><|image_pad|><|vision_end|> describe it"
    ref = llm.generate({"prompt": prompt, "multi_modal_data": {"image": IMAGE}}, greedy())
    assert printed == ref[0].outputs[0].text.strip()


def test_repl_image_command_attaches_to_next_message(vlm_dir: Path, tmp_path: Path) -> None:
    import io

    from PIL import Image

    from tinyvllm.chat import ChatSession
    from tinyvllm.chat.repl import Repl
    from tinyvllm.engine.async_llm import AsyncLLM

    png = tmp_path / "picture.png"
    Image.fromarray(IMAGE).save(png)
    llm = make_llm(vlm_dir)
    parts = [{"type": "image", "image": IMAGE}, {"type": "text", "text": "what is it"}]
    reference = llm.chat([{"role": "user", "content": parts}], greedy(), use_tqdm=False)[0]
    engine = AsyncLLM(llm.engine)
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(ChatSession(engine, greedy()), out=out, err=err)
    try:
        repl.handle("/image /no/such/file.png")
        assert "no such file" in err.getvalue()
        repl.handle(f"/image {png}")
        assert "attached to the next message" in err.getvalue()
        repl.handle("what is it")
        assert out.getvalue().strip() == reference.outputs[0].text.strip()
        assert repl.attached == []
    finally:
        repl.close()
        engine.shutdown(timeout=30)


def test_aborted_request_frees_its_encoder_cache_entry(vlm_dir: Path) -> None:
    llm = make_llm(vlm_dir, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("r", video_request(), greedy())
    engine.step()  # the video's first chunk: encoded, the rest still to come
    state = engine.runner.model_state
    assert state.num_encoded == 1 and len(state.encoder_cache) == 1
    engine.abort_request("r")
    engine.step()  # the runner drops the row
    assert state.encoder_cache == {} and state.rows == {}


@pytest.mark.slow
def test_evs_with_prefix_caching_and_preemption(vlm_dir: Path) -> None:
    """The same video twice under EVS hits the cache and answers the same; a preempted EVS
    request re-encodes and answers as without preemption."""
    llm = make_llm(vlm_dir, video_pruning_rate=0.5, block_size=8)
    first = llm.generate(video_request(), greedy(), use_tqdm=False)[0]
    again = llm.generate(video_request(), greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    tight = make_llm(
        vlm_dir, video_pruning_rate=0.5, block_size=8, num_gpu_blocks_override=8,
        max_model_len=64, enable_prefix_caching=False, max_num_batched_tokens=24,
    )  # fmt: skip
    clips = [CLIP, CLIP[::-1].copy(), np.roll(CLIP, 1, axis=0)]
    outs = tight.generate([video_request(c) for c in clips], greedy(12), use_tqdm=False)
    assert tight.get_stats().total_preemptions > 0
    alone = make_llm(vlm_dir, video_pruning_rate=0.5)
    for clip, out in zip(clips, outs, strict=True):
        ref = alone.generate(video_request(clip), greedy(12), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_mrope_layout_text_continues_past_the_largest_position() -> None:
    """A (4, 2, 2)-token video at 2 tokens per second spans time 3..9: the text after it
    starts at 10 (vLLM's rule; transformers 5.24 would start at 5, which only agrees while a
    video's time extent stays below its width), also when EVS shortened the span."""
    from tinyvllm.models.qwen2_5_vl import MediaInput, prompt_mrope_positions

    video = MediaInput("video", torch.zeros(0, 1), (4, 4, 4))
    positions, starts, delta = prompt_mrope_positions(3 + 16 + 2, [(3, 16, video)], 2, 2.0)
    assert starts == [3]
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert positions[:, 3].tolist() == [3, 3, 3] and positions[:, 18].tolist() == [9, 4, 4]
    assert positions[:, 19:].tolist() == [[10, 11]] * 3
    assert delta == 12 - 21
    pruned, _, pruned_delta = prompt_mrope_positions(3 + 4 + 2, [(3, 4, video)], 2, 2.0)
    assert pruned[:, 7:].tolist() == [[10, 11]] * 3 and pruned_delta == 12 - 9


def test_request_reaching_a_shared_video_later_reuses_its_encoding(vlm_dir: Path) -> None:
    """Two prompts with the same video, admitted together: the second is still in its long
    text when the first finishes the video, yet it reads the cached encoding instead of
    running the encoder again."""
    llm = make_llm(vlm_dir, max_num_batched_tokens=80, enable_prefix_caching=False)
    late = {"prompt": "word " * 40 + VIDEO_PROMPT, "multi_modal_data": {"video": CLIP}}
    outs = llm.generate([video_request(), late], greedy(), use_tqdm=False)
    state = llm.engine.runner.model_state
    assert state.num_encoded == 1 and state.encoder_cache == {}
    alone = make_llm(vlm_dir).generate(late, greedy(), use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_hub_config_layout_loads_the_same_model(vlm_dir: Path, tmp_path: Path) -> None:
    """The hub's Qwen2.5-VL config.json keeps the language model's fields at the top level
    with `rope_scaling: {type: mrope}` and `sliding_window` set but unused; it must build the
    same model as transformers v5's nested layout."""
    import json
    import shutil

    legacy = tmp_path / "legacy"
    shutil.copytree(vlm_dir, legacy)
    config = json.loads((vlm_dir / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("layer_types", "model_type", "sliding_window"):
        text.pop(key)
    config |= text | {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 70,
    }
    config["vision_config"] |= {"model_type": "qwen2_5_vl", "in_chans": 3}
    (legacy / "config.json").write_text(json.dumps(config))
    ours = make_llm(legacy).generate(image_request(), greedy(), use_tqdm=False)[0]
    nested = make_llm(vlm_dir).generate(image_request(), greedy(), use_tqdm=False)[0]
    assert ours.outputs[0].token_ids == nested.outputs[0].token_ids


def test_cli_check_runs_a_vision_language_model_on_text(vlm_dir: Path, capsys: Any) -> None:
    from tinyvllm.cli import main

    argv = ["check", "--model", str(vlm_dir), "--max-tokens", "4", "--max-model-len", "128"]
    assert main(argv) == 0
    assert "greedy agreement 100.0%" in capsys.readouterr().out


def test_video_file_is_sampled_and_matches_its_frames(vlm_dir: Path, tmp_path: Path) -> None:
    """A video file (lossless PNG-in-QuickTime at 10 fps) is decoded with PyAV and sampled to
    32 frames by default (or `num_frames`); its fps spaces the time positions exactly as the
    same frames given in memory with that fps."""
    av = pytest.importorskip("av")
    path = tmp_path / "clip.mov"
    clip = np.concatenate([CLIP] * 5)  # 40 frames
    with av.open(str(path), "w") as container:
        stream = container.add_stream("png", rate=10)
        stream.width, stream.height, stream.pix_fmt = 196, 56, "rgb24"
        for frame in clip:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, "rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    llm = make_llm(vlm_dir)
    video_id = llm.engine.config.model.hf_config.video_token_id
    sampled = llm.generate(video_request(str(path)), greedy(), use_tqdm=False)[0]
    assert sampled.prompt_token_ids.count(video_id) == 16 * 14  # 32 frames, 16 groups
    few = llm.generate(
        video_request((path.as_uri(), {"num_frames": 10})), greedy(), use_tqdm=False
    )[0]
    picks = np.linspace(0, 39, 10).round().astype(int)
    in_memory = (clip[picks], {"fps": 10 * 10 / 40})  # 0.8 s per group: time step 1.6
    ref = llm.generate(video_request(in_memory), greedy(), use_tqdm=False)[0]
    assert few.prompt_token_ids == ref.prompt_token_ids
    assert few.outputs[0].token_ids == ref.outputs[0].token_ids
