"""GPU throughput: nano-vllm's benchmark shape and gpt-fast's batch-1 decode, on a random-weight
Qwen3-0.6B-shaped model (bf16), with no network and no tokenizer.

1. Throughput: `--num-seqs` requests (default 256) with random input and output lengths in
   [100, `--max-input-len`] / [100, `--max-output-len`] (default 1024), ignore_eos, one warm-up;
   reports output tokens/s (nano-vllm's number) and total tokens/s.
2. Batch 1: one 16-token prompt, 256 output tokens; tokens/s and achieved memory bandwidth
   (weight bytes + mean KV bytes read per step, times tokens/s), next to HF transformers'
   batch-1 decode on the same weights when `--hf` is given (the ratio is printed).

    python benchmarks/gpu_bench.py                    # CUDA graphs (when the runner has them)
    python benchmarks/gpu_bench.py --enforce-eager
    python benchmarks/gpu_bench.py --quick            # tiny model and workload (also on CPU)

The last line is one `RESULT key=value ...` line for scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Qwen3-0.6B's published config (hub id Qwen/Qwen3-0.6B), written out so nothing is downloaded.
QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QUICK = {
    "num_hidden_layers": 2,
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
INIT_STD = 0.02
FIRST_ID = 10  # prompts avoid special ids


def qwen3_weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Qwen3 causal LM with tied embeddings."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (hq * d, h),
            p + "self_attn.k_proj.weight": (hkv * d, h),
            p + "self_attn.v_proj.weight": (hkv * d, h),
            p + "self_attn.o_proj.weight": (h, hq * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    return shapes


def build_checkpoint(model_dir: Path, cfg: dict[str, Any], seed: int) -> None:
    """Random bf16 weights (norms 1) as safetensors plus config.json; no transformers needed."""
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, shape in qwen3_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * INIT_STD
            tensors[name] = w.to(torch.bfloat16).cpu()
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def make_llm(model_dir: Path, args: argparse.Namespace, max_model_len: int) -> Any:
    from tinyvllm import LLM

    kwargs: dict[str, Any] = dict(
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return LLM(str(model_dir), **kwargs)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def throughput(llm: Any, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    from tinyvllm import SamplingParams

    rng = random.Random(args.seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(FIRST_ID, vocab) for _ in range(n)]}
        for n in (rng.randint(100, args.max_input_len) for _ in range(args.num_seqs))
    ]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, m))
        for m in [args.max_output_len] * args.num_seqs
    ]
    warmup = {"prompt_token_ids": [FIRST_ID] * 16}
    llm.generate([warmup], SamplingParams(max_tokens=8), use_tqdm=False)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(p.max_tokens for p in params)
    if out_tokens != want:
        raise RuntimeError(f"generated {out_tokens} tokens, expected {want} (ignore_eos)")
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {
        "seqs": args.num_seqs,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (in_tokens + out_tokens) / wall,
    }


def kv_bytes_per_token(cfg: dict[str, Any], dtype_bytes: int = 2) -> int:
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes


def batch1(llm: Any, cfg: dict[str, Any], prompt_len: int, new_tokens: int) -> dict[str, float]:
    from tinyvllm import SamplingParams

    prompt = {"prompt_token_ids": list(range(FIRST_ID, FIRST_ID + prompt_len))}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up at this shape
    sync()
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    sync()
    wall = time.perf_counter() - start
    ttft = getattr(out.metrics, "ttft", None) if getattr(out, "metrics", None) else None
    decode_s = wall - (ttft or 0.0)
    tok_s = (new_tokens - 1) / decode_s
    weight_bytes = getattr(llm.engine.runner, "weight_bytes", 0)
    mean_context = prompt_len + new_tokens / 2
    step_bytes = weight_bytes + mean_context * kv_bytes_per_token(cfg)
    return {
        "tok_s": tok_s,
        "ttft_ms": 1000 * (ttft or 0.0),
        "weight_gb": weight_bytes / 1e9,
        "bandwidth_gb_s": step_bytes * tok_s / 1e9,
    }


def hf_batch1(model_dir: Path, prompt_len: int, new_tokens: int) -> float:
    """HF transformers greedy decode with its own KV cache, batch 1: decode tokens/s."""
    import inspect

    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model = model.to(device).eval()
    # transformers 5.x names the cache argument `cache` in some models; accept either.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else None
    ids = torch.arange(FIRST_ID, FIRST_ID + prompt_len, device=device)[None]

    def run(model: Any, n: int) -> float:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            sync()
            start = time.perf_counter()
            for _ in range(n - 1):
                nxt = out.logits[:, -1:].argmax(-1)
                cache = getattr(out, "cache", None) or out.past_key_values
                out = model(input_ids=nxt, use_cache=True, **{cache_kw or "past_key_values": cache})
            sync()
            return (n - 1) / (time.perf_counter() - start)

    run(model, 8)
    tok_s = run(model, new_tokens)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tok_s


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine batch limit")
    ap.add_argument("--batch1-tokens", type=int, default=256)
    ap.add_argument("--attention-backend", default=None, help="torch | triton (default: auto)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/keep the checkpoint")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers at batch 1")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_seqs = min(args.num_seqs, 8)
        args.max_input_len = min(args.max_input_len, 120)
        args.max_output_len = min(args.max_output_len, 110)
        args.batch1_tokens = min(args.batch1_tokens, 32)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = dict(QWEN3_0_6B, **(QUICK if args.quick else {}))
    with tempfile.TemporaryDirectory(prefix="tinyvllm-bench-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "qwen3-0.6b-random"
        if not (model_dir / "config.json").exists():
            start = time.perf_counter()
            build_checkpoint(model_dir, cfg, args.seed)
            print(f"built random checkpoint in {time.perf_counter() - start:.1f}s: {model_dir}")
        cfg = json.loads((model_dir / "config.json").read_text())
        mode = "eager" if args.enforce_eager else "graphs"
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        print(f"device {device}, torch {torch.__version__}, mode {mode}", flush=True)
        start = time.perf_counter()
        max_len = max(args.max_input_len + args.max_output_len, 16 + args.batch1_tokens)
        llm = make_llm(model_dir, args, max_len)
        backend = llm.engine.runner.backend.name
        print(f"engine up in {time.perf_counter() - start:.1f}s, attention backend {backend}")
        results: dict[str, Any] = {"mode": mode, "device": device, "backend": backend}
        if not args.skip_throughput:
            tp = throughput(llm, args, cfg["vocab_size"])
            results["throughput"] = tp
            print(
                f"throughput: {tp['seqs']} seqs, {tp['output_tokens']} output tokens in "
                f"{tp['wall_s']:.1f}s: {tp['output_tok_s']:.0f} output tok/s "
                f"({tp['total_tok_s']:.0f} total tok/s)",
                flush=True,
            )
        if not args.skip_batch1:
            b1 = batch1(llm, cfg, 16, args.batch1_tokens)
            results["batch1"] = b1
            print(
                f"batch 1: {b1['tok_s']:.1f} tok/s, {b1['bandwidth_gb_s']:.0f} GB/s achieved "
                f"({b1['weight_gb']:.2f} GB weights), TTFT {b1['ttft_ms']:.1f} ms",
                flush=True,
            )
        del llm
        if args.hf and not args.skip_batch1:
            hf = hf_batch1(model_dir, 16, args.batch1_tokens)
            results["hf_batch1_tok_s"] = hf
            print(
                f"HF transformers batch 1: {hf:.1f} tok/s; tinyvllm / HF = "
                f"{results['batch1']['tok_s'] / hf:.2f}x"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    fields = [f"mode={mode}", f"backend={backend}"]
    if "throughput" in results:
        fields.append(f"output_tok_s={results['throughput']['output_tok_s']:.0f}")
    if "batch1" in results:
        fields.append(f"batch1_tok_s={results['batch1']['tok_s']:.1f}")
        fields.append(f"batch1_gb_s={results['batch1']['bandwidth_gb_s']:.0f}")
    if "hf_batch1_tok_s" in results:
        fields.append(f"hf_batch1_tok_s={results['hf_batch1_tok_s']:.1f}")
    print("RESULT " + " ".join(fields), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
