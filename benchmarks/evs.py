"""EVS (video token pruning) on a Qwen2.5-VL-3B-shaped random model: prefill tokens, TTFT and
end-to-end time at video_pruning_rate 0, 0.5 and 0.75, and HF transformers at rate 0.

The clip is synthetic: a static random background with a bright square moving across it
(16 frames at 448 x 448 by default, 8 temporal groups of 16 x 16 merged tokens = 2,048 video
tokens at rate 0). Each configuration runs once after a warm-up request (a different clip, so
nothing is reused: prefix caching is off). Aim: TTFT at rate 0.75 <= 0.35x TTFT at rate 0.

    python benchmarks/evs.py --device cuda            # the full 3B shape, bf16
    python benchmarks/evs.py --quick                  # narrow 2-layer model, 8 x 224 x 224
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Qwen2.5-VL-3B-Instruct's shape (config.json on the hub).
TEXT_3B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                        "rope_theta": 1000000.0},
}  # fmt: skip
VISION_3B: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
}
IDS = {"vision_start": 151652, "vision_end": 151653, "image": 151655, "video": 151656}


@dataclass
class Result:
    engine: str
    rate: float
    prefill_tokens: int
    ttft_s: float
    e2e_s: float
    output: list[int]


def build_checkpoint(path: Path, quick: bool) -> Path:
    if (path / "config.json").exists():
        return path
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text, vision = dict(TEXT_3B), dict(VISION_3B)
    if quick:  # a narrow 2-layer model: checks the script, says nothing about speed
        text |= {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                 "num_attention_heads": 4,
                 "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12],
                                     "rope_theta": 1000000.0}}  # fmt: skip
        vision |= {"depth": 2, "fullatt_block_indexes": [1], "hidden_size": 128,
                   "intermediate_size": 256, "num_heads": 2, "out_hidden_size": 256}  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=IDS["vision_start"],
        vision_end_token_id=IDS["vision_end"],
        image_token_id=IDS["image"],
        video_token_id=IDS["video"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def synthetic_clip(frames: int, size: int, seed: int) -> np.ndarray:
    """A static random background with a 64-pixel bright square crossing it."""
    rng = np.random.default_rng(seed)
    background = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    clip = np.repeat(background[None], frames, axis=0)
    side = max(8, size // 7)
    for t in range(frames):
        x = int((size - side) * t / max(1, frames - 1))
        clip[t, size // 3 : size // 3 + side, x : x + side] = 255
    return clip


def prompt_ids(video_tokens: int = 1) -> list[int]:
    head = [1000 + i for i in range(12)]
    tail = [2000 + i for i in range(8)]
    pads = [IDS["video"]] * video_tokens
    return [*head, IDS["vision_start"], *pads, IDS["vision_end"], *tail]


def run_tinyvllm(path: Path, clip: np.ndarray, rate: float, args: argparse.Namespace) -> Result:
    from tinyvllm import LLM, SamplingParams

    llm = LLM(
        str(path),
        dtype="bfloat16",
        device=args.device,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=args.max_model_len,
        video_pruning_rate=rate,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = synthetic_clip(clip.shape[0], clip.shape[1], seed=99)
    llm.generate({"prompt_token_ids": prompt_ids(), "multi_modal_data": {"video": warm}}, params)
    request = {"prompt_token_ids": prompt_ids(), "multi_modal_data": {"video": clip}}
    _sync(args.device)
    out = llm.generate(request, params, use_tqdm=False)[0]
    metrics = out.metrics
    assert metrics is not None and metrics.ttft is not None and metrics.e2e_latency is not None
    result = Result("tinyvllm", rate, len(out.prompt_token_ids), metrics.ttft,
                    metrics.e2e_latency, list(out.outputs[0].token_ids))  # fmt: skip
    del llm
    gc.collect()
    return result


def run_hf(path: Path, clip: np.ndarray, args: argparse.Namespace) -> Result:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tinyvllm.multimodal.qwen_vl_processing import QwenVLProcessorConfig, process_video

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device).eval()

    def inputs(frames: np.ndarray) -> dict[str, Any]:
        pv, grid = process_video(frames, QwenVLProcessorConfig())
        tokens = int(grid.prod()) // 4
        ids = torch.tensor([prompt_ids(tokens)], device=device)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values_videos": torch.from_numpy(pv).to(device),
            "video_grid_thw": torch.from_numpy(grid).to(device),
            "mm_token_type_ids": 2 * (ids == IDS["video"]).int(),
        }

    def generate(kwargs: dict[str, Any], n: int) -> tuple[float, list[int]]:
        _sync(args.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**kwargs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(args.device)
        return time.perf_counter() - start, out[0, kwargs["input_ids"].shape[1] :].tolist()

    generate(inputs(synthetic_clip(clip.shape[0], clip.shape[1], seed=99)), 2)  # warm-up
    kwargs = inputs(clip)
    ttft, _ = generate(kwargs, 1)
    e2e, tokens = generate(kwargs, args.max_tokens)
    return Result("transformers", 0.0, kwargs["input_ids"].shape[1], ttft, e2e, tokens)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 frames of 224")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.75])
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    frames = args.frames or (8 if args.quick else 16)
    size = args.size or (224 if args.quick else 448)
    name = "qwen2_5_vl_3b_random" + ("_quick" if args.quick else "")
    path = build_checkpoint(args.checkpoint or Path("/tmp") / name, args.quick)
    clip = synthetic_clip(frames, size, seed=0)
    results = [run_tinyvllm(path, clip, rate, args) for rate in args.rates]
    if not args.no_hf:
        results.append(run_hf(path, clip, args))
    base = next((r for r in results if r.engine == "tinyvllm" and r.rate == 0.0), None)
    print(f"clip: {frames} frames of {size}x{size}; {args.max_tokens} new tokens")
    print(f"{'engine':<13}{'rate':>6}{'prefill tok':>13}{'TTFT s':>10}{'e2e s':>9}{'TTFT/r0':>9}")
    for r in results:
        ratio = f"{r.ttft_s / base.ttft_s:.2f}x" if base else "-"
        print(f"{r.engine:<13}{r.rate:>6.2f}{r.prefill_tokens:>13}{r.ttft_s:>10.3f}"
              f"{r.e2e_s:>9.3f}{ratio:>9}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
