"""Hybrid models (recurrent state beside attention): shared-prefix TTFT with prefix caching of
state snapshots off / on (cold) / on (warm), next to HF transformers, and single-stream decode
tokens/s next to a same-size Llama.

The model is a random-weight LFM2-350M-shaped checkpoint (`--kind lfm2`; hybrids registered
later, e.g. Granite 4.0-H, add their shape to SHAPES). The workload is prefix_cache.py's:
N requests share a 1,024-token system prompt and ask their own 32-token question, all at once;
the warm wave asks new questions after the system prompt was cached (a hybrid resumes from the
recurrent-state snapshot taken where that prompt ends). Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from bench_report import machine_info
from prefix_cache import Result, render, run_hf, run_tinyvllm
from throughput import FIRST_ID

CACHE_DIR = Path("~/.cache/tinyvllm/bench")
QUICK_LAYERS = 4

# LiquidAI/LFM2-350M's shape (attention at layers 2, 5, 8, 10, 12, 14; conv elsewhere).
LFM2_350M: dict[str, Any] = {
    "architectures": ["Lfm2ForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 6656,
    "block_auto_adjust_ff_dim": True,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256,
    "num_hidden_layers": 16,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "conv_L_cache": 3,
    "conv_bias": False,
    "norm_eps": 1e-5,
    "vocab_size": 65536,
    "max_position_embeddings": 128000,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 7,
    "pad_token_id": 0,
}

# The same-size transformer: LFM2-350M's width, depth, heads and adjusted MLP, all attention.
LLAMA_LIKE_LFM2: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4608,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": 65536,
    "max_position_embeddings": 128000,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 7,
}

SHAPES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # kind -> (transformers config class, hybrid config, same-size Llama config)
    "lfm2": ("Lfm2Config", LFM2_350M, LLAMA_LIKE_LFM2),
}


def _quick(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config, num_hidden_layers=QUICK_LAYERS)
    if "full_attn_idxs" in config:
        config["full_attn_idxs"] = [1, 3]
    return config


def build_checkpoint(model_dir: Path, config_class: str, config: dict[str, Any], seed: int) -> None:
    """A deterministic random-weight bf16 checkpoint (built once, then reused)."""
    if (model_dir / "config.json").exists():
        return
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, config_class)(**config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    model.to(torch.bfloat16).save_pretrained(model_dir)


def shared_prefix_prompts(
    n: int, system_len: int, question_len: int, vocab: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(FIRST_ID, vocab) for _ in range(system_len)]
    return [
        system + [rng.randrange(FIRST_ID, vocab) for _ in range(question_len)] for _ in range(n)
    ]


def decode_tok_s(llm: Any, params_cls: Any, new_tokens: int, vocab: int) -> float:
    """Single-stream decode: generated tokens per second after the first token."""
    prompt = [random.Random(1).randrange(FIRST_ID, vocab) for _ in range(32)]
    params = params_cls(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(3):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        decode_s = out.metrics.e2e_latency - out.metrics.ttft
        rates.append((new_tokens - 1) / decode_s)
    return statistics.median(rates)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("tinyvllm") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tinyvllm import LLM, SamplingParams

    config_class, hybrid_cfg, llama_cfg = SHAPES[args.kind]
    if args.quick:
        hybrid_cfg, llama_cfg = _quick(hybrid_cfg), _quick(llama_cfg)
    suffix = "-quick" if args.quick else ""
    hybrid_dir = CACHE_DIR.expanduser() / f"{args.kind}-350m-random{suffix}"
    llama_dir = CACHE_DIR.expanduser() / f"{args.kind}-350m-llama-random{suffix}"
    build_checkpoint(hybrid_dir, config_class, hybrid_cfg, args.seed)
    build_checkpoint(llama_dir, "LlamaConfig", llama_cfg, args.seed)
    vocab = hybrid_cfg["vocab_size"]
    info = machine_info()

    prompts = shared_prefix_prompts(
        args.num_requests, args.system_len, args.question_len, vocab, args.seed
    )
    warm = [list(p) for p in prompts]
    rng = random.Random(args.seed + 1)
    for p in warm:  # the second wave: the same system prompt, new questions
        p[args.system_len :] = [rng.randrange(FIRST_ID, vocab) for _ in range(args.question_len)]
    kwargs = {
        "dtype": args.dtype,
        "skip_tokenizer_init": True,
        "max_model_len": args.system_len + args.question_len + args.new_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.num_requests,
    }
    results: list[Result] = []
    warm_outputs: dict[str, list[list[int]] | None] = {}
    for caching in (False, True):
        llm = LLM(str(hybrid_dir), enable_prefix_caching=caching, **kwargs)
        run_tinyvllm(llm, "warm-up", [p[:64] for p in prompts[:2]], 2, SamplingParams)
        llm.reset_prefix_cache()
        label = "on, cold cache" if caching else "off"
        results.append(
            run_tinyvllm(
                llm, f"tinyvllm, caching {label}", prompts, args.new_tokens, SamplingParams
            )
        )
        print(f"  {results[-1].engine}: {results[-1].wall_s:.1f} s", flush=True)
        name = "tinyvllm, caching on, warm cache" if caching else "warm wave, caching off"
        wave = run_tinyvllm(llm, name, warm, args.new_tokens, SamplingParams)
        warm_outputs[name] = wave.outputs
        if caching:
            stats = llm.get_stats()
            print(f"  {name}: {wave.wall_s:.1f} s ({stats.state_hits} state hits)", flush=True)
            wave.outputs = None
            results.append(wave)
        del llm
        gc.collect()
    if not args.skip_hf:
        results.append(run_hf(hybrid_dir, prompts, args.new_tokens, args.dtype))
        print(f"  {results[-1].engine}: {results[-1].wall_s:.1f} s", flush=True)

    decode: dict[str, float] = {}
    for label, path in (("hybrid", hybrid_dir), ("llama", llama_dir)):
        llm = LLM(str(path), dtype=args.dtype, skip_tokenizer_init=True, max_model_len=512)
        decode[label] = decode_tok_s(llm, SamplingParams, args.decode_tokens, vocab)
        del llm
        gc.collect()

    print()
    print(render(results, args, info))
    same = sum(
        a == b
        for a, b in zip(
            warm_outputs["tinyvllm, caching on, warm cache"] or [],
            warm_outputs["warm wave, caching off"] or [],
            strict=True,
        )
    )
    print(f"warm-cache wave: {same}/{len(warm)} greedy outputs identical to caching off")
    off = next(r for r in results if r.engine == "tinyvllm, caching off")
    hot = next(r for r in results if r.engine.endswith("warm cache"))
    print(f"warm-cache TTFT: {off.ttft_mean_ms / hot.ttft_mean_ms:.1f}x better than caching off")
    print(
        f"\nsingle-stream decode ({args.decode_tokens} tokens, {args.dtype}): "
        f"{args.kind} {decode['hybrid']:.1f} tok/s, same-size Llama {decode['llama']:.1f} tok/s "
        f"({decode['hybrid'] / decode['llama']:.2f}x)"
    )
    if args.out is not None:
        payload = {
            "machine": info,
            "args": {k: str(v) for k, v in vars(args).items()},
            "results": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results],
            "decode_tok_s": decode,
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="lfm2", choices=sorted(SHAPES))
    p.add_argument("--quick", action="store_true", help="4 layers, 8 requests: smoke test")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
        args.system_len = min(args.system_len, 256)
    return args


if __name__ == "__main__":
    sys.exit(main())
