"""EVS (video token pruning) on a Qwen2.5-VL-3B-shaped random model: prefill tokens, TTFT and
end-to-end time at video_pruning_rate 0, 0.5 and 0.75, and HF transformers at rate 0.

The clip is synthetic: a static random background with a bright square moving across it
(16 frames at 448 x 448 by default, 8 temporal groups of 16 x 16 merged tokens = 2,048 video
tokens at rate 0). Each configuration runs once after a warm-up request (a different clip, so
nothing is reused: prefix caching is off). Aim: TTFT at rate 0.75 <= 0.35x TTFT at rate 0.

Per run it also times the stages of the first token: the vision tower, the EVS scoring, and
the language model's prefill forwards, and prints the FLOPs of the tower and of the prefill
at each rate with the bound they set on TTFT(rate) / TTFT(0): EVS prunes after the tower, so
the tower's work does not fall with the rate.

    python benchmarks/evs.py --device cuda            # the full 3B shape, bf16
    python benchmarks/evs.py --quick                  # narrow 2-layer model, 8 x 224 x 224
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
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
    # Stage times of the timed request (seconds): vision tower, EVS scoring, and the
    # language model's forwards over prompt tokens (its prefill).
    stages: dict[str, float] = field(default_factory=dict)


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


def _timed(stages: dict[str, float], name: str, fn: Callable[..., Any], device: str) -> Any:
    """`fn` that adds its run time to stages[name] (synchronising a GPU around it)."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        _sync(device)
        start = time.perf_counter()
        out = fn(*a, **kw)
        _sync(device)
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - start
        return out

    return wrapper


def _instrument(llm: Any, device: str) -> dict[str, float]:
    """Stage timers on the engine's model and model state (in-process engine only)."""
    stages: dict[str, float] = {}
    runner = llm.engine.runner
    model, state = runner.model, runner.model_state
    model.embed_media = _timed(stages, "vision", model.embed_media, device)
    if hasattr(state, "pruning_rate"):
        state.select_tokens = _timed(stages, "evs", state.select_tokens, device)
    forward = model.forward

    def lm_forward(input_ids: torch.Tensor, *a: Any, **kw: Any) -> Any:
        # Forwards over more than one token are prefill steps (one request, no decode mixed in).
        name = "lm_prefill" if input_ids.shape[0] > 1 else "lm_decode"
        return _timed(stages, name, forward, device)(input_ids, *a, **kw)

    model.forward = lm_forward
    return stages


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
    warm = synthetic_clip(args.warmup_frames or clip.shape[0], clip.shape[1], seed=99)
    llm.generate({"prompt_token_ids": prompt_ids(), "multi_modal_data": {"video": warm}}, params)
    request = {"prompt_token_ids": prompt_ids(), "multi_modal_data": {"video": clip}}
    stages = _instrument(llm, args.device)
    _sync(args.device)
    out = llm.generate(request, params, use_tqdm=False)[0]
    metrics = out.metrics
    assert metrics is not None and metrics.ttft is not None and metrics.e2e_latency is not None
    result = Result("tinyvllm", rate, len(out.prompt_token_ids), metrics.ttft,
                    metrics.e2e_latency, list(out.outputs[0].token_ids), stages)  # fmt: skip
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

    warm = synthetic_clip(args.warmup_frames or clip.shape[0], clip.shape[1], seed=99)
    generate(inputs(warm), 2)  # warm-up
    kwargs = inputs(clip)
    stages: dict[str, float] = {}
    visual = model.model.visual
    visual.forward = _timed(stages, "vision", visual.forward, args.device)
    ttft, _ = generate(kwargs, 1)
    del visual.forward
    e2e, tokens = generate(kwargs, args.max_tokens)
    return Result("transformers", 0.0, kwargs["input_ids"].shape[1], ttft, e2e, tokens, stages)


def vision_flops(vision: dict[str, Any], grid: tuple[int, int, int]) -> float:
    """Matmul FLOPs of one forward of the tower over a patch grid (t, h, w): patch embedding,
    per block qkv / proj / gated MLP and attention (windows or whole frames), the merger."""
    t, h, w = grid
    n, d, inter = t * h * w, vision["hidden_size"], vision["intermediate_size"]
    patch_dim = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    side = vision["window_size"] // vision["patch_size"]  # window side in patches
    window = min(side, h) * min(side, w)  # patches a windowed block's query sees (about)
    linear = 2 * n * (3 * d * d + d * d + 3 * d * inter)
    blocks = 0.0
    for i in range(vision["depth"]):
        span = h * w if i in vision["fullatt_block_indexes"] else window
        blocks += linear + 4 * n * span * d
    m = vision["spatial_merge_size"] ** 2
    merger = 2 * (n // m) * (m * d) * (m * d + vision["out_hidden_size"])
    return 2 * n * patch_dim * d + blocks + merger


def lm_prefill_flops(text: dict[str, Any], tokens: int) -> float:
    """Matmul FLOPs of the language model's prefill of `tokens` (causal attention, the
    last token's logits)."""
    d, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    head = d // text["num_attention_heads"]
    qkv = d * (d + 2 * text["num_key_value_heads"] * head)
    per_token = 2 * layers * (qkv + d * d + 3 * d * inter)
    attention = 2 * layers * tokens * tokens * d  # QK^T and PV over the causal half
    return tokens * per_token + attention + 2 * d * text["vocab_size"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def print_bound(path: Path, clip: np.ndarray, results: list[Result]) -> None:
    """FLOPs of the tower and of each rate's prefill, and the TTFT ratio they allow if every
    FLOP ran at one speed: (vision + LM(rate)) / (vision + LM(0))."""
    from tinyvllm.multimodal.qwen_vl_processing import QwenVLProcessorConfig, process_video

    config = json.loads((path / "config.json").read_text())
    _, grid = process_video(clip, QwenVLProcessorConfig())
    vision = vision_flops(config["vision_config"], tuple(int(x) for x in grid[0]))
    runs = [r for r in results if r.engine == "tinyvllm"]
    base = next((r for r in runs if r.rate == 0.0), None)
    print(f"FLOPs: vision tower {vision / 1e12:.3f} T (every rate)")
    for r in runs:
        lm = lm_prefill_flops(config["text_config"], r.prefill_tokens)
        line = f"  rate {r.rate:.2f}: LM prefill {lm / 1e12:.3f} T"
        if base is not None:
            lm0 = lm_prefill_flops(config["text_config"], base.prefill_tokens)
            line += f"; bound TTFT/r0 >= {(vision + lm) / (vision + lm0):.2f}x"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 frames of 224")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--warmup-frames",
        type=int,
        default=None,
        help="frames of the warm-up clip (default: as many as the clip)",
    )
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
    print(f"{'engine':<13}{'rate':>6}{'prefill tok':>13}{'TTFT s':>10}{'e2e s':>9}{'TTFT/r0':>9}"
          f"{'vision s':>10}{'EVS s':>8}{'LM prefill s':>14}")  # fmt: skip
    for r in results:
        ratio = f"{r.ttft_s / base.ttft_s:.2f}x" if base else "-"
        st = r.stages
        print(f"{r.engine:<13}{r.rate:>6.2f}{r.prefill_tokens:>13}{r.ttft_s:>10.3f}"
              f"{r.e2e_s:>9.3f}{ratio:>9}{st.get('vision', 0):>10.3f}{st.get('evs', 0):>8.3f}"
              f"{st.get('lm_prefill', 0):>14.3f}")  # fmt: skip
    print_bound(path, clip, results)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
