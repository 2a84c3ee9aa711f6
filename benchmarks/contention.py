"""Decode throughput when other programs compete for the cores.

Single-stream (1 x 32 -> N) and batch-16 (16 x 32 -> N) greedy decode on the random
SmolLM2-135M-shaped model of `throughput.py`, quiet and then with 1 and 2 competing CPU-bound
processes (busy loops this script starts and kills), for tinyvllm through `LLM.generate` and
through `AsyncLLM.generate` (one engine each, each in a process of its own, as applications run
them), and for llama.cpp when `llama_cpp` is importable and `--gguf` names the checkpoint's
GGUF. Rounds interleave every (engine, load)
cell so drift on a shared box hits all alike; a cell reports its best round and the ratio to
the same engine's quiet best. Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import machine_info
from throughput import (
    DEFAULT_MODEL_DIR,
    MAX_MODEL_LEN,
    MODEL_CONFIG,
    Workload,
    ensure_checkpoint,
    make_workloads,
)

# A CPU-bound competitor that exits when its parent (this script) is gone, even when this
# script is killed before it can kill the competitors.
BUSY_LOOP = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


@dataclass
class Cell:
    """Every round's tok/s of one (engine, workload, competitors) combination."""

    samples: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return max(self.samples)


@contextmanager
def competitors(count: int) -> Iterator[None]:
    """`count` busy-looping Python processes for the duration of the block.

    Each in a session of its own, like a program started elsewhere (a browser): with the
    kernel's autogroup scheduling, processes of one session share one group's CPU time, so a
    competitor in the benchmark's session would compete with it inside its own share."""
    procs = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True)
        for _ in range(count)
    ]
    try:
        time.sleep(0.3 if count else 0.0)  # let them reach the loop and the scheduler see them
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def generate_runner(llm: Any, params: Callable[[Workload], list[Any]]) -> Callable:
    def run_generate(wl: Workload) -> float:
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        start = time.perf_counter()
        outs = llm.generate(prompts, params(wl), use_tqdm=False)
        wall = time.perf_counter() - start
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != wl.max_tokens:
            raise RuntimeError(f"LLM.generate {wl.key}: output lengths {got}")
        return wall

    return run_generate


MODE_NAMES = {
    "generate": "tinyvllm LLM.generate",
    "async": "tinyvllm AsyncLLM",
    "pool-switch": "tinyvllm LLM.generate, pool switch only",
}


def tinyvllm_runner(
    model_dir: Path, engine_kwargs: dict[str, Any], mode: str
) -> Callable[[Workload], float]:
    """run(workload) -> wall seconds on a new engine of front end `mode` (MODE_NAMES)."""
    if importlib.util.find_spec("tinyvllm") is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.engine.async_llm import AsyncLLM

    def params(wl: Workload) -> list[Any]:
        return [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.max_tokens
        ]

    if mode == "pool-switch":
        # The previous release's policy: no step's thread count is chosen by measuring both
        # modes; the native pool alone switches to the caller when its workers stall.
        plain = LLM(model=str(model_dir), **engine_kwargs)
        platform = plain.engine.runner.platform
        platform.start_step = lambda tokens, native: None
        platform.finish_step = lambda: None
        return generate_runner(plain, params)
    if mode == "generate":
        return generate_runner(LLM(model=str(model_dir), **engine_kwargs), params)
    allm = AsyncLLM(str(model_dir), **engine_kwargs)

    async def last_length(prompt: list[int], sp: Any) -> int:
        last = None
        async for out in allm.generate({"prompt_token_ids": prompt}, sp):
            last = out
        assert last is not None
        return len(last.outputs[0].token_ids)  # cumulative

    async def submit_all(wl: Workload) -> list[int]:
        # AsyncLLM's own API, as a server drives it: every request is posted before the
        # engine's next step. (The blocking `stream()` waits for the engine to accept each
        # request, up to one step, so N of them submitted from one thread arrive over N
        # steps and batch 16 runs at ~0.7x.)
        pairs = zip(wl.prompts, params(wl), strict=True)
        return list(await asyncio.gather(*(last_length(p, sp) for p, sp in pairs)))

    def run_async(wl: Workload) -> float:
        start = time.perf_counter()
        got = asyncio.run(submit_all(wl))
        wall = time.perf_counter() - start
        if got != wl.max_tokens:
            raise RuntimeError(f"AsyncLLM {wl.key}: output lengths {got}")
        return wall

    return run_async


class Worker:
    """One tinyvllm front end in a process of its own, as an application runs one engine:
    engines in one process share the native thread pool and torch's threads, and a second
    engine's thread (AsyncLLM's) competes with the first for the GIL and the cores. Runs a
    workload per request over a pipe (this script with `--worker MODE`)."""

    def __init__(self, mode: str, argv: Sequence[str]) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", mode]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._reply()  # the engine is built

    def _reply(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited with {self.proc.wait()} (its error above)")
        return json.loads(line)

    def __call__(self, wl: Workload) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(wl.key + "\n")
        self.proc.stdin.flush()
        return float(self._reply())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def serve_worker(mode: str, model_dir: Path, workloads: list[Workload],
                 engine_kwargs: dict[str, Any]) -> int:  # fmt: skip
    """The `--worker` side: one JSON line when ready, then one per workload key read."""
    run = tinyvllm_runner(model_dir, engine_kwargs, mode)
    by_key = {wl.key: wl for wl in workloads}
    print(json.dumps(True), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(by_key[line.strip()])), flush=True)
    return 0


def llama_cpp_runner(gguf: Path, threads: int) -> Callable[[Workload], float]:
    """llama-cpp-python has no batched API: requests run one after another."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=MAX_MODEL_LEN, n_threads=threads, verbose=False)

    def run(wl: Workload) -> float:
        start = time.perf_counter()
        for prompt, want in zip(wl.prompts, wl.max_tokens, strict=True):
            llm.reset()
            llm.eval(prompt)
            for i in range(want):
                tok = int(llm.sample(top_k=1, temp=0.0))
                if i + 1 < want:
                    llm.eval([tok])
        return time.perf_counter() - start

    return run


def measure(
    runners: dict[str, Callable[[Workload], float]],
    workloads: list[Workload],
    loads: Sequence[int],
    rounds: int,
    skip: frozenset[tuple[str, str]] = frozenset(),
) -> tuple[dict[tuple[str, str, int], Cell], list[float]]:
    """Every (engine, workload) cell not in `skip`, at every load, `rounds` times."""
    cells: dict[tuple[str, str, int], Cell] = {}
    loadavgs: list[float] = []
    for rnd in range(rounds):
        # Alternate the load order so no load level always follows another.
        order = list(loads) if rnd % 2 == 0 else list(reversed(loads))
        for count in order:
            with competitors(count):
                for name, run in runners.items():
                    for wl in workloads:
                        if (name, wl.key) in skip:
                            continue
                        tok_s = wl.counted_tokens / run(wl)
                        cells.setdefault((name, wl.key, count), Cell()).samples.append(tok_s)
                        loadavgs.append(os.getloadavg()[0])
                        print(
                            f"  round {rnd + 1} competitors {count} {name} ({wl.key}): "
                            f"{tok_s:,.1f} tok/s, load {loadavgs[-1]:.1f}",
                            flush=True,
                        )
    return cells, loadavgs


def render(
    cells: dict[tuple[str, str, int], Cell],
    names: Sequence[str],
    workloads: list[Workload],
    loads: Sequence[int],
) -> str:
    head = ["engine", "workload"]
    for count in loads:
        head += [f"{count} competing tok/s", "ratio"] if count else ["quiet tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        for wl in workloads:
            quiet = cells.get((name, wl.key, loads[0]))
            row = [name, wl.label]
            for count in loads:
                cell = cells.get((name, wl.key, count))
                row.append(f"{cell.best:,.1f}" if cell else "-")
                if count:
                    ok = cell is not None and quiet is not None
                    row.append(f"{cell.best / quiet.best:.2f}x" if ok else "-")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (best is reported)")
    p.add_argument("--loads", default="0,1,2", help="competing processes per cell, 0 first")
    p.add_argument("--workloads", default="b,a", help="b = single stream, a = batch 16")
    p.add_argument(
        "--modes",
        default="generate,async",
        help="tinyvllm front ends, each in a process of its own: generate, async, pool-switch "
        "(LLM.generate without the per-step thread choice), or none",
    )
    p.add_argument("--gguf", type=Path, default=None, help="GGUF of the checkpoint for llama.cpp")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: cores)")
    p.add_argument(
        "--peer-workloads",
        default=None,
        help="workloads llama.cpp runs (default: all; its batch 16 is 16 requests in a row)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--worker", choices=sorted(MODE_NAMES), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.load_counts = [int(x) for x in args.loads.split(",")]
    if not args.load_counts or args.load_counts[0] != 0 or min(args.load_counts) < 0:
        p.error(f"--loads must start with 0 (the quiet baseline); got {args.loads!r}")
    args.model_dir = args.model_dir.expanduser()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_checkpoint(args.model_dir, MODEL_CONFIG["num_hidden_layers"], args.seed)
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    workloads = []
    for wl in make_workloads(keys, False, MODEL_CONFIG["vocab_size"], args.seed):
        wl.max_tokens = [args.tokens] * len(wl.prompts)
        wl.label = f"{len(wl.prompts)} x {len(wl.prompts[0])} -> {args.tokens}"
        workloads.append(wl)
    workloads.sort(key=lambda wl: keys.index(wl.key))
    info = machine_info()
    engine_kwargs: dict[str, Any] = {
        "dtype": "bfloat16",
        "skip_tokenizer_init": True,
        "max_model_len": MAX_MODEL_LEN,
        "seed": args.seed,
    }
    if args.worker:
        return serve_worker(args.worker, args.model_dir, workloads, engine_kwargs)
    modes = [m for m in args.modes.split(",") if m and m != "none"]
    argv = list(sys.argv[1:] if argv is None else argv)
    workers = {MODE_NAMES[mode]: Worker(mode, argv) for mode in modes}
    runners: dict[str, Callable[[Workload], float]] = dict(workers)
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: skipped (llama_cpp is not installed)")
    elif args.gguf is None:
        print("llama.cpp: skipped (pass --gguf, the checkpoint as a bf16 GGUF)")
    else:
        runners["llama.cpp"] = llama_cpp_runner(args.gguf, args.threads or info["cores_visible"])
    peer_keys = set((args.peer_workloads or args.workloads).split(","))
    skip = frozenset(("llama.cpp", wl.key) for wl in workloads if wl.key not in peer_keys)
    for name, run in runners.items():  # warm-up: first-call costs stay out of every cell
        for wl in workloads:
            if (name, wl.key) not in skip:
                run(wl)
    try:
        cells, loadavgs = measure(runners, workloads, args.load_counts, args.rounds, skip)
    finally:
        for worker in workers.values():
            worker.close()
    print()
    print(render(cells, list(runners), workloads, args.load_counts))
    print(
        f"\n- machine: {info['cpu']}, {info['cores_visible']} cores visible, "
        f"ISA {'/'.join(info['bf16_isa'])}, torch {info['torch']}, {info['date']}"
    )
    print(
        f"- 1-min load average during the runs: min {min(loadavgs):.1f}, max {max(loadavgs):.1f}"
        f" (the competitors themselves add 1 or 2); best of {args.rounds} interleaved rounds"
    )
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "machine": info,
                    "loadavg": loadavgs,
                    "cells": [
                        {"engine": n, "workload": k, "competitors": c, "tok_s": cell.samples}
                        for (n, k, c), cell in cells.items()
                    ],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
