"""Where the milliseconds of one CPU decode step go.

Runs single-stream (or batch-B) greedy decoding of the random-weight SmolLM2-135M-shaped
benchmark model (see throughput.py) and splits the wall time of an engine step into
scheduler, input preparation, model, logits, sampling and output processing; then times each
kernel of the native decode program on the model's own weights (every layer in turn, so
weights come from memory as in a real step) and reports achieved bandwidth. `--gguf FILE`
profiles a real GGUF instead (e.g. SmolLM2-135M-Instruct Q4_1), `--int8-activations` with
its opt-in int8 GEMVs.

"Same window": the native decode program and lm_head, run back to back on the last step's
inputs right after the engine run, against their medians inside the engine run. Compare
isolated kernel timings with engine steps only this way: on a shared box the load moves
both by 2x within a minute.

    python benchmarks/decode_profile.py [--batch 1] [--threads 2] [--eager] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODEL_DIR = Path("~/.cache/tinyvllm/bench/smollm2-135m-random").expanduser()


def _timed(acc: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t

    return wrapper


def _recorded(
    samples: dict[str, list[Any]], name: str, fn: Callable[..., Any]
) -> Callable[..., Any]:
    """`fn`, keeping each call's arguments and wall seconds in samples[name]."""

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            samples[name].append((args, time.perf_counter() - t))

    return wrapper


def same_window(llm: Any, samples: dict[str, list[Any]], reps: int) -> list[str]:
    """Median ms of the decode program and lm_head inside the engine run (single-token steps),
    then on the last step's inputs now, per thread count: in turn as in a step, and each
    back to back with itself (as an isolated kernel timing runs: its weights stay cached)."""
    from tinyvllm.utils.cpu import torch_intra_op_threads

    runner = llm.engine.runner
    native = getattr(runner.platform, "native", None)
    if runner.decode_program is None or native is None or not samples["program"]:
        return ["(no native decode program)"]
    calls = {
        "program": (runner.decode_program.run.__wrapped__, samples["program"][-1][0]),
        "lm_head": (
            (runner.decode_logits or runner.model.compute_logits).__wrapped__,
            samples["lm_head"][-1][0],
        ),
    }
    lines = []
    for name, (_, args) in calls.items():
        inside = [t for a, t in samples[name][1:] if a[0].shape[0] == args[0].shape[0]]
        lines.append(f"{name:<8} in engine {_median_ms(inside):7.3f} ms")

    def timed(names: tuple[str, ...], threads: int) -> dict[str, list[float]]:
        times: dict[str, list[float]] = defaultdict(list)
        with torch.inference_mode(), torch_intra_op_threads(1):
            for _ in range(reps):
                native.lib.tv_pool_govern(threads)
                for name in names:
                    fn, args = calls[name]
                    t = time.perf_counter()
                    fn(*args)
                    times[name].append(time.perf_counter() - t)
                native.lib.tv_pool_govern(0)
        return times

    for threads in (native.step_threads.threads, 1):
        in_turn = timed(("program", "lm_head"), threads)
        for name in calls:
            alone = timed((name,), threads)[name]
            lines.append(f"{name:<8} {threads} threads: in turn {_median_ms(in_turn[name]):7.3f} "
                         f"ms, back to back {_median_ms(alone):7.3f} ms")  # fmt: skip
    return lines


def _median_ms(seconds: list[float]) -> float:
    return sorted(seconds)[len(seconds) // 2] * 1e3


def step_breakdown(
    llm: Any, batch: int, new_tokens: int, samples: dict[str, list[Any]]
) -> dict[str, float]:
    import tinyvllm.runner.model_runner as runner_module
    from tinyvllm import SamplingParams

    engine = llm.engine
    runner = engine.runner
    acc: dict[str, float] = defaultdict(float)
    for name, label in (("prepare_inputs", "inputs"), ("build_sampling_metadata", "sampling md")):
        setattr(runner_module, name, _timed(acc, f"  {label}", getattr(runner_module, name)))
    native = getattr(runner.platform, "native", None)
    if native is not None:  # each step's thread count, and whether it was a trial
        choice = native.step_threads
        choose = choice.choose

        def recorded_choose(num_tokens: int) -> int:
            threads = choose(num_tokens)
            samples["threads"].append((threads, choice.trial))
            return threads

        choice.choose = recorded_choose
    engine.scheduler.schedule = _timed(acc, "scheduler", engine.scheduler.schedule)
    runner.execute_model = _timed(acc, "runner (all)", runner.execute_model)
    runner._forward = _timed(acc, "  model forward", runner._forward)
    if runner.decode_program is not None:
        runner.decode_program.run = _recorded(samples, "program", runner.decode_program.run)
    # A decode step's logits come from the runner's DecodeLogits where it has one (GGUF heads).
    head = "decode_logits" if runner.decode_logits is not None else "compute_logits"
    owner = runner if runner.decode_logits is not None else runner.model
    timed_head = _timed(acc, "  lm_head (logits)", getattr(owner, head))
    setattr(owner, head, _recorded(samples, "lm_head", timed_head))
    runner.sampler.forward = _timed(acc, "  sampler", runner.sampler.forward)
    # Plain greedy steps take their argmax here instead of in the sampler.
    runner_module.greedy_tokens = _timed(acc, "  sampler", runner_module.greedy_tokens)
    engine.step = _timed(acc, "engine step (total)", engine.step)
    prompts = [{"prompt_token_ids": list(range(3 + i, 35 + i))} for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    acc.clear()
    samples.clear()
    steps_before = engine.get_stats().num_steps
    llm.generate(prompts, params, use_tqdm=False)
    steps = engine.get_stats().num_steps - steps_before
    return {k: v / steps * 1e3 for k, v in acc.items()} | {"steps": steps}


def kernel_breakdown(
    llm: Any, batch: int, context: int, reps: int
) -> list[tuple[str, float, float]]:
    """(kernel, ms per step, GB/s) for the native kernels on the model's own weights."""
    runner = llm.engine.runner
    ops = runner.platform.native
    layers = list(runner.model.model.layers)
    hidden = layers[0].input_layernorm.weight.shape[0]
    dtype = layers[0].input_layernorm.weight.dtype
    x = torch.randn(batch, hidden).to(dtype)
    rows: list[tuple[str, float, float]] = []

    def run(name: str, fn: Callable[[Any], Any], nbytes: Callable[[Any], int]) -> None:
        for layer in layers:  # warm
            fn(layer)
        t = time.perf_counter()
        for _ in range(reps):
            for layer in layers:
                fn(layer)
        ms = (time.perf_counter() - t) / reps * 1e3
        total = sum(nbytes(layer) for layer in layers)
        rows.append((name, ms, total / (ms / 1e3) / 1e9))

    def linear(attr: str) -> Callable[[Any], Any]:
        def fn(layer: Any) -> Any:
            mod = _get(layer, attr)
            xin = torch.randn(batch, mod.input_size).to(dtype) if mod.input_size != hidden else x
            return ops.linear(xin, mod.weight, mod.bias)

        return fn

    def wbytes(attr: str) -> Callable[[Any], int]:
        def nbytes(layer: Any) -> int:
            weight = _get(layer, attr).weight
            return weight.numel() * weight.element_size()

        return nbytes

    for attr in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        run(attr.split(".")[-1], linear(attr), wbytes(attr))

    def norms(layer: Any) -> None:
        ops.rms_norm(x, None, layer.input_layernorm.weight, 1e-5)
        ops.rms_norm(x, None, layer.post_attention_layernorm.weight, 1e-5)

    run("rms_norm x2", norms, lambda layer: 0)
    attn0 = layers[0].self_attn.attn
    kv = attn0.kv_cache
    bs = kv.shape[2]
    nb = -(-context // bs)
    block_table = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb) % kv.shape[1]
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, attn0.num_heads, attn0.head_dim).to(dtype)
    out = torch.empty_like(q)
    tok = torch.arange(batch)

    def attend(layer: Any) -> None:
        a = layer.self_attn.attn
        ops.paged_decode(q, out, tok, tok, seq_lens, block_table, a.kv_cache, a.scale, None, None)

    kv_bytes = 2 * batch * context * attn0.num_kv_heads * attn0.head_dim * kv.element_size()
    run(f"attention (context {context})", attend, lambda layer: kv_bytes)
    head = runner.model.lm_head.weight
    t = time.perf_counter()
    for _ in range(reps):
        ops.linear(x, head, None)
    ms = (time.perf_counter() - t) / reps * 1e3
    rows.append(("lm_head", ms, head.numel() * head.element_size() / (ms / 1e3) / 1e9))
    return rows


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="enforce_eager (no native kernels)")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    p.add_argument("--gguf", type=Path, help="a real GGUF file instead of --model-dir")
    p.add_argument("--int8-activations", action="store_true", help="with --gguf")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from tinyvllm import LLM

    if args.gguf is not None:
        llm = LLM(str(args.gguf), max_model_len=1024, int8_activations=args.int8_activations,
                  enforce_eager=args.eager)  # fmt: skip
    elif not (args.model_dir / "config.json").exists():
        raise SystemExit(f"{args.model_dir} missing: run benchmarks/throughput.py once first")
    else:
        llm = LLM(str(args.model_dir), dtype="bfloat16", max_model_len=1024,
                  skip_tokenizer_init=True, kv_cache_memory_bytes=512 << 20,
                  enforce_eager=args.eager)  # fmt: skip
    samples: dict[str, list[Any]] = defaultdict(list)
    steps = step_breakdown(llm, args.batch, args.new_tokens, samples)
    print(f"## engine step, batch {args.batch}, {args.threads} threads "
          f"({'eager' if args.eager else 'native'}), {steps.pop('steps')} steps")  # fmt: skip
    for name, ms in steps.items():
        print(f"{name:<24} {ms:8.3f} ms")
    modes = samples["threads"]
    if modes:
        alone = sum(threads == 1 for threads, _ in modes)
        trials = sum(trial for _, trial in modes)
        print(f"thread choice: {len(modes) - alone} steps on all threads, {alone} alone "
              f"({trials} of them trials)")  # fmt: skip
    print("\n## same window")
    print("\n".join(same_window(llm, samples, 30)))
    if getattr(llm.engine.runner.platform, "native", None) is not None and args.gguf is None:
        print(f"\n## native kernels, batch {args.batch}, summed over all layers")
        for name, ms, gbs in kernel_breakdown(llm, args.batch, 64, 20):
            print(f"{name:<24} {ms:8.3f} ms  {gbs:6.1f} GB/s")
    import os

    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
