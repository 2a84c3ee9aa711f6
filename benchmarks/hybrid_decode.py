"""Hybrid decode per step next to a same-size Llama, interleaved: the hybrid with and without
the native decode program (the per-layer path) and the Llama (always in the program), round by
round so that load changes on a shared box hit all three alike.

Uses hybrid.py's random-weight checkpoints (built on first use). Per round and engine: one
batch of `--batch` requests decodes `--new-tokens` tokens; ms/step is the decode wall time
(after the first token) over the decode steps; the median over rounds is reported.

    python benchmarks/hybrid_decode.py [--kind lfm2] [--batch 1 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench_report import machine_info
from hybrid import CACHE_DIR, SHAPES, build_checkpoint
from throughput import FIRST_ID


def decode_ms_per_step(llm: Any, params_cls: Any, batch: int, new_tokens: int, vocab: int) -> float:
    """Wall ms per decode step of a `batch`-request greedy batch (prefill excluded)."""
    rng = random.Random(batch)
    prompts = [
        {"prompt_token_ids": [rng.randrange(FIRST_ID, vocab) for _ in range(32)]}
        for _ in range(batch)
    ]
    params = params_cls(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    first = max(o.metrics.ttft for o in outs)  # every request's prompt is in by then
    return (time.perf_counter() - start - first) / (new_tokens - 1) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("tinyvllm") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tinyvllm import LLM, SamplingParams

    config_class, hybrid_cfg, llama_cfg = SHAPES[args.kind]
    hybrid_dir = CACHE_DIR.expanduser() / f"{args.kind}-350m-random"
    llama_dir = CACHE_DIR.expanduser() / f"{args.kind}-350m-llama-random"
    build_checkpoint(hybrid_dir, config_class, hybrid_cfg, args.seed)
    build_checkpoint(llama_dir, "LlamaConfig", llama_cfg, args.seed)
    vocab = hybrid_cfg["vocab_size"]
    kwargs = {"dtype": args.dtype, "skip_tokenizer_init": True, "max_model_len": 512}
    hybrid = LLM(str(hybrid_dir), **kwargs)
    llama = LLM(str(llama_dir), **kwargs)
    program = hybrid.engine.runner.decode_program

    def with_program(on: bool) -> Callable[[], Any]:
        def select() -> Any:
            hybrid.engine.runner.decode_program = program if on else None
            return hybrid

        return select

    engines: dict[str, Callable[[], Any]] = {
        f"{args.kind}, per-layer path": with_program(False),
        f"{args.kind}, decode program": with_program(True),
        "same-size Llama": lambda: llama,
    }
    if program is None:
        print(f"note: {args.kind} got no native decode program here")
        del engines[f"{args.kind}, decode program"]
    info = machine_info()
    print(f"{info}\nload average at start: {os.getloadavg()}")
    for batch in args.batch:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for get in engines.values():  # warm-up
            decode_ms_per_step(get(), SamplingParams, batch, 4, vocab)
        order = list(engines.items())
        for _ in range(args.rounds):
            order.reverse()  # ABC CBA ...: no engine always runs right after another
            for name, get in order:
                times[name].append(
                    decode_ms_per_step(get(), SamplingParams, batch, args.new_tokens, vocab)
                )
        llama_ms = statistics.median(times["same-size Llama"])
        print(f"\nbatch {batch}, {args.dtype}, median of {args.rounds} interleaved rounds:")
        for name, samples in times.items():
            ms = statistics.median(samples)
            print(
                f"  {name:32s} {ms:7.1f} ms/step  {batch * 1e3 / ms:6.1f} tok/s  "
                f"{llama_ms / ms:.2f}x Llama's speed  (rounds: "
                + ", ".join(f"{t:.0f}" for t in samples)
                + ")"
            )
    print(f"load average at end: {os.getloadavg()}")
    gc.collect()
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="lfm2", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=17)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
