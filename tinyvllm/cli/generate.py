"""`tinyvllm generate` and `tinyvllm check`."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from tinyvllm.cli.common import (
    cli_engine_kwargs,
    read_stdin,
    resolve_cli_model,
    sampling_params_from,
)

if TYPE_CHECKING:
    from collections.abc import Mapping


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyvllm import LLM
    from tinyvllm.engine.engine import check_text

    params = sampling_params_from(args)  # bad flags fail here, before a model load
    prompts = args.prompt or [read_stdin()]
    for i, prompt in enumerate(prompts):
        check_text(prompt, f"prompt {i}")  # e.g. undecodable bytes in argv
    model, kwargs, _ = resolve_cli_model(
        args.model, cli_engine_kwargs(args), args.revision, args.gguf_file, args.draft
    )
    llm = LLM(model, **kwargs)
    start = time.perf_counter()
    media = {k: v for k, v in (("image", args.image), ("video", args.video)) if v}
    if args.chat:
        parts = _media_parts(media)
        conversations = [
            [{"role": "user", "content": [*parts, {"type": "text", "text": p}] if parts else p}]
            for p in prompts
        ]
        outputs = llm.chat(conversations, params)
    elif media:
        placeholders = llm.placeholders()
        outputs = llm.generate([_media_prompt(p, media, placeholders) for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n, failed = 0, 0
    for i, out in enumerate(outputs):
        if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
            failed += 1
            print(f"tinyvllm: error: prompt {i} failed: {out.error}", file=sys.stderr)
            continue
        for comp in out.outputs:
            print(comp.text)
            n += len(comp.token_ids)
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 1 if failed else 0


def _media_parts(media: dict[str, list[str]]) -> list[dict[str, Any]]:
    return [
        {"type": f"{kind}_url", f"{kind}_url": {"url": path}}
        for kind, paths in media.items()
        for path in paths
    ]


def _media_prompt(
    prompt: str, media: dict[str, list[str]], placeholders: Mapping[str, str]
) -> dict[str, Any]:
    """A plain prompt with --image / --video files: their placeholders (the model's) go first
    unless the prompt already places them."""
    head = "".join(
        placeholders[kind] * len(paths)
        for kind, paths in media.items()
        if kind in placeholders and placeholders[kind] not in prompt
    )
    return {"prompt": head + prompt, "multi_modal_data": media}


def cmd_check(args: argparse.Namespace) -> int:
    from tinyvllm import LLM
    from tinyvllm.parity import DEFAULT_PROMPTS, load_hf_reference, run_parity
    from tinyvllm.sampling_params import SamplingParams

    SamplingParams(max_tokens=args.max_tokens)  # a bad --max-tokens fails before the load

    model, kwargs, _ = resolve_cli_model(
        args.model, cli_engine_kwargs(args), args.revision, args.gguf_file
    )
    kwargs["dtype"] = "float32"
    # Parity is about the implementation: run the same (dequantized) weights HF runs.
    kwargs["quantization"] = args.quantization or "none"
    llm = LLM(model, **kwargs)
    model_path = llm.engine.config.model.model_path
    print(f"loading the transformers reference for {model_path} ...", end="", file=sys.stderr)
    sys.stderr.flush()
    start = time.perf_counter()
    hf = load_hf_reference(model_path)
    print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    report = run_parity(llm, hf, args.prompt or DEFAULT_PROMPTS, max_tokens=args.max_tokens)
    print(report.summary())
    return 0 if report.identical and report.max_logprob_diff < args.tolerance else 1
