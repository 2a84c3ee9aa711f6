"""Prefill only, engines taking turns: tinyvllm (this tree, and optionally another source tree
such as the commit before a change) against HF transformers in bf16 and fp32.

Workloads: (c) 8 x 512-token prompts -> 1 token, throughput.py's (c) token ids, and (L) one
4,096-token prompt -> 1 token (no prefix cache hits). Each engine lives in its own worker
process for the whole run (start-up not timed); every round runs each workload once on every
engine, the engines' order rotating per round, so a load spike on the shared box hits all of
them alike. Reports the best round per engine and workload (prompt tok/s), the ratio to the
best HF run, greedy agreement with HF fp32, and each worker's peak RSS.

    flock /tmp/tinyvllm-bench.lock python benchmarks/prefill.py [--rounds 3]
        [--before /path/to/old/source/tree] [--engines tinyvllm,hf-bf16,hf-fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
LONG_LEN = 4096


def workloads(vocab: int, seed: int) -> dict[str, list[list[int]]]:
    from throughput import FIRST_ID, make_workloads

    (c,) = make_workloads(["c"], quick=False, vocab=vocab, seed=seed)
    rng = np.random.default_rng(seed + 100)
    return {"c": c.prompts, "L": [rng.integers(FIRST_ID, vocab, size=LONG_LEN).tolist()]}


def _tinyvllm_runner(model_dir: str, seed: int) -> Any:
    from tinyvllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=LONG_LEN + 8,
        max_num_seqs=256,
        max_num_batched_tokens=LONG_LEN,
        enable_prefix_caching=False,
        seed=seed,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


def _hf_runner(model_dir: str, dtype: str) -> Any:
    import torch
    from throughput import hf_generate
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    return lambda prompts: hf_generate(model, prompts, 1)


def worker(engine: str, model_dir: str, seed: int) -> None:
    """Serve workload keys from stdin, one JSON line per run on stdout."""
    sys.path.insert(0, str(HERE))
    from throughput import MODEL_CONFIG

    prompts = workloads(MODEL_CONFIG["vocab_size"], seed)
    if engine.startswith("tinyvllm"):
        run = _tinyvllm_runner(model_dir, seed)
    else:
        run = _hf_runner(model_dir, {"hf-bf16": "bfloat16", "hf-fp32": "float32"}[engine])
    for key in prompts:  # warm-up: first-call costs of both shapes
        run(prompts[key])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        key = line.strip()
        start = time.perf_counter()
        tokens = run(prompts[key])
        wall = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"wall": wall, "tokens": tokens, "rss_mib": rss}), flush=True)


def long_context_dir(model_dir: Path) -> Path:
    """`model_dir` with max_position_embeddings raised to fit (L), next to it: the random
    SmolLM2-shaped checkpoint says 2,048 (SmolLM2's own value), which tinyvllm enforces.
    Weights are symlinked; the default rotary embedding does not read that value."""
    target = model_dir.with_name(model_dir.name + "-long")
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 2 * LONG_LEN
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for f in model_dir.iterdir():
        link = target / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f.resolve())
    return target


class Worker:
    def __init__(self, engine: str, src: Path, args: argparse.Namespace) -> None:
        env = dict(os.environ, PYTHONPATH=str(src))
        cmd = [sys.executable, __file__, "--worker", engine, "--model-dir", str(args.model_dir)]
        self.engine = engine
        self.proc = subprocess.Popen(
            [*cmd, "--seed", str(args.seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._read()  # ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.engine} worker exited (code {self.proc.wait()})")

    def run(self, key: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(key + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default="tinyvllm,hf-bf16,hf-fp32")
    p.add_argument("--before", type=Path, help="another tinyvllm source tree, run as 'before'")
    p.add_argument("--workloads", default="c,L")
    p.add_argument(
        "--model-dir", type=Path, default=Path("~/.cache/tinyvllm/bench/smollm2-135m-random")
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model_dir = args.model_dir.expanduser()
    if args.worker:
        worker(args.worker, str(args.model_dir), args.seed)
        return 0
    if not (args.model_dir / "config.json").exists():
        raise SystemExit(f"no checkpoint in {args.model_dir}: run benchmarks/throughput.py once")
    args.model_dir = long_context_dir(args.model_dir)
    repo = HERE.parent
    engines: list[tuple[str, Path]] = [(e, repo) for e in args.engines.split(",")]
    if args.before is not None:
        engines.insert(1, ("tinyvllm-before", args.before.resolve()))
    keys = args.workloads.split(",")
    print(f"load average at start {os.getloadavg()}", flush=True)
    workers = [Worker(e, src, args) for e, src in engines]
    walls: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    rss: dict[str, float] = {}
    sizes = {"c": 8 * 512, "L": LONG_LEN}
    for r in range(args.rounds):
        for key in keys:
            order = workers[r % len(workers) :] + workers[: r % len(workers)]
            for w in order:
                res = w.run(key)
                walls.setdefault((w.engine, key), []).append(res["wall"])
                tokens[(w.engine, key)] = res["tokens"]
                rss[w.engine] = res["rss_mib"]
                rate = sizes[key] / res["wall"]
                print(f"round {r} {key} {w.engine}: {rate:.0f} tok/s", flush=True)
    for w in workers:
        w.close()
    print(f"load average at end {os.getloadavg()}\n")
    print(f"| tok/s (best of {args.rounds}) | {' | '.join(keys)} | peak RSS MiB |")
    print("|---|" + "---|" * (len(keys) + 1))
    best = {k: sizes[k[1]] / min(v) for k, v in walls.items()}
    for e, _ in engines:
        cells = [f"{best[(e, k)]:,.0f}" for k in keys]
        print(f"| {e} | {' | '.join(cells)} | {rss[e]:,.0f} |")
    for e in (e for e, _ in engines if e.startswith("tinyvllm")):
        peers = [p for p, _ in engines if p.startswith("hf")]
        if peers:
            ratios = [best[(e, k)] / max(best[(p, k)] for p in peers) for k in keys]
            print(f"| {e} / best HF | {' | '.join(f'{x:.2f}x' for x in ratios)} | |")
    if any(e == "hf-fp32" for e, _ in engines):
        for e, _ in engines:
            same = [tokens[(e, k)] == tokens[("hf-fp32", k)] for k in keys]
            print(f"greedy tokens of {e} == HF fp32: {dict(zip(keys, same, strict=True))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
