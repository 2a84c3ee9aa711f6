"""Command line: `tinyvllm generate | check` (chat, tui, bench and serve come with later faces)."""

from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", required=True, help="local directory, .gguf file or hub id")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--revision", default=None)
    p.add_argument("--gguf-file", default=None, help="a .gguf file inside --model's directory")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--quantization",
        default=None,
        help="auto (keep a GGUF file's quantized blocks) | none (dequantize) | int8 | int4 | gguf;"
        " default: auto, except check: none",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "device": args.device,
        "seed": args.seed,
        "revision": args.revision,
        "gguf_file": args.gguf_file,
        "trust_remote_code": args.trust_remote_code,
        "quantization": args.quantization or "auto",
    }


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyvllm import LLM, SamplingParams

    prompts = args.prompt or [sys.stdin.read()]
    llm = LLM(args.model, **_engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
    )
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n = 0
    for out in outputs:
        for comp in out.outputs:
            print(comp.text)
            n += len(comp.token_ids)
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from tinyvllm import LLM
    from tinyvllm.parity import DEFAULT_PROMPTS, load_hf_reference, run_parity

    kwargs = _engine_kwargs(args)
    kwargs["dtype"] = "float32"
    # Parity is about the implementation: run the same (dequantized) weights HF runs.
    kwargs["quantization"] = args.quantization or "none"
    llm = LLM(args.model, **kwargs)
    hf = load_hf_reference(llm.engine.config.model.model_path)
    report = run_parity(llm, hf, args.prompt or DEFAULT_PROMPTS, max_tokens=args.max_tokens)
    print(report.summary())
    return 0 if report.identical and report.max_logprob_diff < args.tolerance else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_args(gen)
    gen.add_argument("prompt", nargs="*", help="prompt(s); read from stdin when absent")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=cmd_generate)

    chk = sub.add_parser(
        "check", help="compare greedy tokens and logprobs with HF transformers (fp32)"
    )
    _add_engine_args(chk)
    chk.add_argument("prompt", nargs="*", help="prompts (a built-in set when absent)")
    chk.add_argument("--max-tokens", type=int, default=32)
    chk.add_argument("--tolerance", type=float, default=1e-3, help="max |logprob diff|")
    chk.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"tinyvllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
