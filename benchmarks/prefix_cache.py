"""Shared-prefix workload: tinyvllm with prefix caching on vs off, and HF transformers.

N requests share one long system prompt and differ in a short question (defaults: 32 requests,
1,024 + 32 prompt tokens, 32 new tokens each), all submitted at once. Reported per engine:
mean and p50 TTFT, wall time, total (prompt + generated) tokens/s and generated tokens/s.
tinyvllm runs three ways on the same model and ids: caching off, caching on with a cold cache
(the first request computes the system prompt; requests admitted in the same step compute it
too, since a block is reusable only once its KV exists), and caching on with the system prompt
already cached (a second wave). Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_report import machine_info
from throughput import (
    DEFAULT_MODEL_DIR,
    FIRST_ID,
    MODEL_CONFIG,
    QUICK_LAYERS,
    ensure_checkpoint,
    hf_generate,
    peak_rss_mib,
)


@dataclass
class Result:
    engine: str
    wall_s: float
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    total_tok_s: float
    gen_tok_s: float
    prefix_hit_rate: float | None = None
    outputs: list[list[int]] | None = None


def make_prompts(n: int, system_len: int, question_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = MODEL_CONFIG["vocab_size"]
    system = [rng.randrange(FIRST_ID, vocab) for _ in range(system_len)]
    return [
        system + [rng.randrange(FIRST_ID, vocab) for _ in range(question_len)] for _ in range(n)
    ]


def run_tinyvllm(
    llm: Any, name: str, prompts: list[list[int]], new_tokens: int, params_cls: Any
) -> Result:
    before = llm.get_stats()
    params = params_cls(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.get_stats()
    ttfts = [1000 * o.metrics.ttft for o in outs]
    queries = after.prefix_queries - before.prefix_queries
    hits = after.prefix_hits - before.prefix_hits
    tokens = sum(len(p) for p in prompts) + new_tokens * len(prompts)
    return Result(
        name,
        wall,
        statistics.mean(ttfts),
        statistics.median(ttfts),
        tokens / wall,
        new_tokens * len(prompts) / wall,
        hits / queries if queries else None,
        [list(o.outputs[0].token_ids) for o in outs],
    )


class _FirstTokenClock:
    """A generate() streamer that notes when the first generated tokens arrive."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> Result:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None
    hf_generate(model, [p[:64] for p in prompts[:2]], 2)  # warm-up
    clock = _FirstTokenClock()
    ids = torch.tensor(prompts)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0
    )
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            streamer=clock,
        )
    wall = time.perf_counter() - start
    ttft = 1000 * ((clock.first_token_at or time.perf_counter()) - start)
    tokens = sum(len(p) for p in prompts) + new_tokens * len(prompts)
    outputs = out[:, ids.shape[1] :].tolist()
    del model
    gc.collect()
    return Result(
        "HF (one batch)",
        wall,
        ttft,
        ttft,
        tokens / wall,
        new_tokens * len(prompts) / wall,
        None,
        outputs,
    )


def render(results: list[Result], args: argparse.Namespace, info: dict[str, Any]) -> str:
    base = next((r for r in results if r.engine == "tinyvllm, caching off"), results[0])
    lines = [
        f"{args.num_requests} requests x ({args.system_len} shared + {args.question_len} own) "
        f"prompt tokens -> {args.new_tokens} new each, {args.dtype}, {info['cpu']}, "
        f"{info['torch_threads']} threads, {info['date']}",
        "",
        "| engine | TTFT mean (ms) | TTFT p50 (ms) | wall (s) | total tok/s | gen tok/s "
        "| prefix hit rate | total tok/s vs caching off |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hit = "-" if r.prefix_hit_rate is None else f"{100 * r.prefix_hit_rate:.0f}%"
        lines.append(
            f"| {r.engine} | {r.ttft_mean_ms:,.0f} | {r.ttft_p50_ms:,.0f} | {r.wall_s:.1f} | "
            f"{r.total_tok_s:,.0f} | {r.gen_tok_s:,.1f} | {hit} | "
            f"{r.total_tok_s / base.total_tok_s:.2f}x |"
        )
    ref = base.outputs or []
    for r in results:
        if r.outputs is not None and r is not base:
            same = sum(a == b for a, b in zip(r.outputs, ref, strict=True))
            lines.append(f"\n{r.engine}: {same}/{len(ref)} greedy outputs identical to caching off")
    lines.append(f"\npeak RSS {peak_rss_mib():,.0f} MiB; load average {info['loadavg_start']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--quick", action="store_true", help="4 layers, 8 requests: smoke test")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    # This CPU has no native bf16 matmul, where an fp32 prefill is several times faster for
    # both engines; pass --dtype bfloat16 on machines that have it.
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    args.model_dir = args.model_dir.expanduser()
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
        if args.model_dir == DEFAULT_MODEL_DIR.expanduser():
            args.model_dir = args.model_dir.with_name(args.model_dir.name + "-quick")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    num_layers = QUICK_LAYERS if args.quick else MODEL_CONFIG["num_hidden_layers"]
    ensure_checkpoint(args.model_dir, num_layers, args.seed)
    if importlib.util.find_spec("tinyvllm") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tinyvllm import LLM, SamplingParams

    info = machine_info()
    prompts = make_prompts(args.num_requests, args.system_len, args.question_len, args.seed)
    warm_prompts = make_prompts(args.num_requests, args.system_len, args.question_len, args.seed)
    # The second wave shares the system prompt but asks new questions.
    rng = random.Random(args.seed + 1)
    for p in warm_prompts:
        p[args.system_len :] = [rng.randrange(FIRST_ID, 1000) for _ in range(args.question_len)]
    kwargs = {
        "dtype": args.dtype,
        "skip_tokenizer_init": True,
        "max_model_len": args.system_len + args.question_len + args.new_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.num_requests,
    }
    results = []
    for caching in (False, True):
        llm = LLM(str(args.model_dir), enable_prefix_caching=caching, **kwargs)
        run_tinyvllm(llm, "warm-up", [p[:64] for p in prompts[:2]], 2, SamplingParams)
        llm.reset_prefix_cache()
        label = "on, cold cache" if caching else "off"
        results.append(
            run_tinyvllm(
                llm, f"tinyvllm, caching {label}", prompts, args.new_tokens, SamplingParams
            )
        )
        print(f"  {results[-1].engine}: {results[-1].wall_s:.1f} s", flush=True)
        if caching:
            results.append(
                run_tinyvllm(
                    llm,
                    "tinyvllm, caching on, warm cache",
                    warm_prompts,
                    args.new_tokens,
                    SamplingParams,
                )
            )
            print(f"  {results[-1].engine}: {results[-1].wall_s:.1f} s", flush=True)
        del llm
        gc.collect()
    warm_ref = None
    if not args.skip_hf:
        results.append(run_hf(args.model_dir, prompts, args.new_tokens, args.dtype))
        print(f"  {results[-1].engine}: {results[-1].wall_s:.1f} s", flush=True)
    # The warm wave has other prompts: compare it with caching off on the same prompts.
    llm = LLM(str(args.model_dir), enable_prefix_caching=False, **kwargs)
    warm_ref = run_tinyvllm(llm, "check", warm_prompts, args.new_tokens, SamplingParams).outputs
    warm = next(r for r in results if r.engine.endswith("warm cache"))
    warm_same = sum(a == b for a, b in zip(warm.outputs or [], warm_ref or [], strict=True))
    warm.outputs = None
    print()
    print(render(results, args, info))
    print(
        f"warm-cache wave: {warm_same}/{len(warm_prompts)} greedy outputs identical to caching off"
    )
    if args.out is not None:
        payload = {
            "machine": info,
            "args": {k: str(v) for k, v in vars(args).items()},
            "results": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results],
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
