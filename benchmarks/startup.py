"""Start-up and memory on a real GGUF (SmolLM2-135M-Instruct Q4_1 by default): tinyvllm vs
llama.cpp.

Each run is a fresh process (the file and the libraries warm in the page cache, as on any start
after the first), interleaved engine by engine, best of N:

- ready: process start to a loaded engine (`LLM("SmolLM2-135M-Instruct")`, `Llama(path)`),
  interpreter and imports included, and the load call alone;
- first token: process start to the first generated token of a short greedy prompt;
- peak RSS: the process's ru_maxrss at exit;
- `tinyvllm chat`: process start to the first byte of the answer the REPL streams.

The children may write bytecode caches even where PYTHONDONTWRITEBYTECODE is set (an
installed package has them; compiling tinyvllm's modules on every start costs ~1 s here).

Usage: python benchmarks/startup.py [--model NAME] [--runs 3] [--threads 2] [--baseline DIR]
(`--model`: a catalog GGUF model already on disk, e.g. Gemma-3-270M; `tinyvllm chat` is timed
for chat models only.)
(`--baseline`: another tinyvllm source tree, e.g. `git worktree add /tmp/base <commit>`, run
interleaved with this one for a before/after in the same conditions.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"

_CHILD = r"""
import json, resource, sys, time
start = float(sys.argv[1])
engine, path, threads, model = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
if engine == "tinyvllm":
    from tinyvllm import LLM, SamplingParams
    t = time.time()
    llm = LLM(model)
    load, ready = time.time() - t, time.time() - start
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
else:
    from llama_cpp import Llama
    t = time.time()
    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, verbose=False)
    load, ready = time.time() - t, time.time() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Printed before decoding too: if decoding crashes, the load is still measured.
    print(json.dumps({"ready": ready, "load": load, "rss_mib": rss}), flush=True)
    next(iter(llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0, top_k=1)))
first = time.time() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"ready": ready, "load": load, "first": first, "rss_mib": rss}), flush=True)
""".replace("PROMPT", repr(PROMPT))


def _child_env(threads: int, source: str | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # The tree this script is in, unless another is asked for (the children run elsewhere).
    env["PYTHONPATH"] = source or str(Path(__file__).resolve().parents[1])
    return env


def run_engine(
    engine: str, path: Path, threads: int, model: str, source: str | None = None
) -> dict[str, Any]:
    env = _child_env(threads, source)
    start = time.time()
    argv = [repr(start), engine.split()[0], str(path), str(threads), model]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),  # not the checkout: PYTHONPATH says which tinyvllm runs
        timeout=600,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    result = dict(lines[-1]) if lines else {}
    if proc.returncode != 0:
        result["error"] = f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}"
    return result


def run_chat(threads: int, model: str) -> dict[str, Any]:
    """`tinyvllm chat`: process start to the first byte of the streamed answer."""
    env = _child_env(threads)
    command = [sys.executable, "-m", "tinyvllm.cli", "chat", "-m", model]
    start = time.time()
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"Say hello.\n")
    proc.stdin.flush()
    first = proc.stdout.read(1)
    elapsed = time.time() - start
    proc.kill()
    proc.wait()
    return {"first": elapsed} if first else {"error": "no answer"}


def best(results: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in results if key in r]
    return min(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a catalog GGUF model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--baseline", default=None, help="another tinyvllm source tree")
    args = parser.parse_args()
    from tinyvllm.catalog.entries import load_catalog
    from tinyvllm.gguf.bundled import catalog_gguf_path

    path = catalog_gguf_path(args.model)
    entry = load_catalog().get(args.model)
    if path is None or entry is None:
        sys.exit(f"{args.model} is not on disk: `tinyvllm chat -m {args.model}` fetches it")
    engines = ["tinyvllm"]
    sources = {"tinyvllm": None, "tinyvllm base": args.baseline}
    if args.baseline is not None:
        engines.append("tinyvllm base")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: skipped (llama_cpp is not installed)")
    else:
        engines.append("llama.cpp")
    for engine in engines[: 1 + (args.baseline is not None)]:  # warm the caches, untimed
        run_engine(engine, path, args.threads, args.model, sources[engine])
    chat = ["tinyvllm chat"] if entry.chat else []
    results: dict[str, list[dict[str, Any]]] = {e: [] for e in [*engines, *chat]}
    for _ in range(args.runs):
        for engine in engines:
            run = run_engine(engine, path, args.threads, args.model, sources.get(engine))
            results[engine].append(run)
        if chat:
            results["tinyvllm chat"].append(run_chat(args.threads, args.model))
    load = os.getloadavg()
    print(
        f"{args.model}: {args.runs} runs each, best shown; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(f"{'':14} {'ready':>8} {'load call':>10} {'1st token':>10} {'peak RSS':>10}")
    for engine, runs in results.items():
        cells = [best(runs, k) for k in ("ready", "load", "first", "rss_mib")]
        text = [f"{v:.2f} s" if v is not None else "-" for v in cells[:3]]
        rss = f"{cells[3]:.0f} MiB" if cells[3] is not None else "-"
        print(f"{engine:14} {text[0]:>8} {text[1]:>10} {text[2]:>10} {rss:>10}")
        for r in runs:
            if "error" in r:
                print(f"  {engine}: {r['error']}")
    if "llama.cpp" in results:
        ours, theirs = best(results["tinyvllm"], "rss_mib"), best(results["llama.cpp"], "rss_mib")
        if ours and theirs:
            print(f"peak RSS ratio tinyvllm / llama.cpp: {ours / theirs:.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
