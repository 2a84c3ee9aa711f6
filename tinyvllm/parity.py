"""Parity check: tinyvllm against HF transformers on the same weights and prompts.

Both sides decode greedily; tinyvllm's chosen-token logprobs are compared with HF's logprobs
for the same tokens (teacher-forced), so one early divergence does not hide later numerics.
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
]


@dataclass
class PromptParity:
    prompt_token_ids: list[int]
    ours: list[int]
    reference: list[int]
    max_logprob_diff: float

    @property
    def first_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.ours, self.reference, strict=False)):
            if a != b:
                return i
        return (
            None
            if len(self.ours) == len(self.reference)
            else min(len(self.ours), len(self.reference))
        )


@dataclass
class ParityReport:
    results: list[PromptParity] = field(default_factory=list)

    @property
    def token_agreement(self) -> float:
        """Fraction of generated positions before the first divergence, over all prompts."""
        total = sum(len(r.reference) for r in self.results)
        same = sum(
            len(r.reference) if r.first_divergence is None else r.first_divergence
            for r in self.results
        )
        return same / max(total, 1)

    @property
    def max_logprob_diff(self) -> float:
        return max((r.max_logprob_diff for r in self.results), default=0.0)

    @property
    def identical(self) -> bool:
        return all(r.first_divergence is None for r in self.results)

    def summary(self) -> str:
        lines = []
        for i, r in enumerate(self.results):
            div = r.first_divergence
            status = "identical" if div is None else f"diverges at token {div}"
            lines.append(
                f"prompt {i}: {len(r.ours)} tokens, {status}, "
                f"max |logprob diff| {r.max_logprob_diff:.2e}"
            )
        lines.append(
            f"greedy agreement {self.token_agreement:.1%}, "
            f"max |logprob diff| {self.max_logprob_diff:.2e}"
        )
        return "\n".join(lines)


def hf_greedy(
    hf_model: Any, prompt_ids: list[int], max_tokens: int, split: int | None = None
) -> list[int]:
    """Plain greedy decoding with HF's own KV cache, no stopping at EOS.

    With `split`, the prompt goes in as prompt[:split] and then the rest onto HF's cache: the
    reference for a prefix-cache hit that resumes after `split` tokens (hybrids: from a
    recurrent-state snapshot)."""
    import inspect

    import torch

    # transformers 5.x renamed `past_key_values` to `cache`; accept either.
    cache_kw = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else None

    def forward(ids: list[int], out: Any = None) -> Any:
        kwargs = {}
        if out is not None:
            kwargs[cache_kw or "past_key_values"] = getattr(out, "cache", None) or (
                out.past_key_values
            )
        return hf_model(input_ids=torch.tensor([ids]), use_cache=True, **kwargs)

    with torch.no_grad():
        if split is None:
            out = forward(prompt_ids)
        else:
            out = forward(prompt_ids[split:], forward(prompt_ids[:split]))
        tokens: list[int] = []
        for _ in range(max_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = forward(tokens[-1:], out)
    return tokens


def hf_token_logprobs(hf_model: Any, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """HF's logprob of each of `tokens` following `prompt_ids` (teacher forcing)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt_ids + tokens])
        logits = hf_model(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        start = len(prompt_ids) - 1
        idx = torch.arange(start, start + len(tokens))
        return logprobs[idx, torch.tensor(tokens)].tolist()


def load_hf_reference(model_path: str, dtype: str = "float32") -> Any:
    """The HF model for a model directory, or for a .gguf file (transformers dequantizes it).

    transformers' own progress bars (one redraw per GGUF tensor, then "Loading weights") are
    kept off stderr; what they held is shown only if the load fails.
    """
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from tinyvllm.gguf.reader import is_gguf_file

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": "eager"}
    path = Path(model_path)
    auto: Any = AutoModelForCausalLM
    if is_gguf_file(path):
        model_path, kwargs["gguf_file"] = str(path.parent), path.name
    elif getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None:
        auto = AutoModelForImageTextToText  # a vision-language model, checked on text
    # The GGUF conversion uses a plain tqdm that no transformers switch turns off.
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            model = auto.from_pretrained(model_path, **kwargs)
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise
    return model.eval()


def run_parity(
    llm: Any,
    hf_model: Any,
    prompts: list[str] | list[list[int]],
    max_tokens: int = 32,
) -> ParityReport:
    """Greedy-decode `prompts` (batched) in tinyvllm and one by one in HF; compare."""
    from tinyvllm.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompt_ids = [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    report = ParityReport()
    for ids, out in zip(prompt_ids, outputs, strict=True):
        comp = out.outputs[0]
        ours_lp = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
        ref_lp = hf_token_logprobs(hf_model, ids, comp.token_ids)
        diff = max((abs(a - b) for a, b in zip(ours_lp, ref_lp, strict=True)), default=0.0)
        report.results.append(
            PromptParity(ids, comp.token_ids, hf_greedy(hf_model, ids, max_tokens), diff)
        )
    return report
