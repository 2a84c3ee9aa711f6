"""The server's cost: tokens/s through `tinyvllm serve` with concurrent streaming clients vs the
same workload through `AsyncLLM` in-process, and the TTFT overhead of one request.

Both sides run the same model with the same engine arguments on the same token-id prompts,
greedy with exactly `--max-tokens` tokens each (ignore_eos). The in-process run goes first, in
this process; its engine is shut down before the server starts as a subprocess (the real
`tinyvllm serve` command), so the two never compete for the CPU. The clients stream
/v1/completions over loopback with the HTTP library the openai client is built on and parse
every event, as a real client would. Usage: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "bench"


@dataclass
class Workload:
    clients: int
    requests_per_client: int
    prompt_len: int
    max_tokens: int
    ttft_repeats: int


@dataclass
class Result:
    tokens: int
    seconds: float
    ttft_median: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _http() -> Any:
    try:
        import httpx
    except ImportError:  # newer openai releases ship it as httpx2
        import httpx2 as httpx
    return httpx


def make_prompts(w: Workload, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    n = w.clients * w.requests_per_client
    return [[rng.randrange(100, vocab - 100) for _ in range(w.prompt_len)] for _ in range(n)]


# ---- in-process -----------------------------------------------------------------------------
async def _in_process(llm: Any, w: Workload, prompts: list[list[int]]) -> Result:
    from tinyvllm import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=w.max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )

    async def one(prompt: list[int]) -> tuple[int, float]:
        start = time.perf_counter()
        first, tokens = None, 0
        async for out in llm.generate({"prompt_token_ids": prompt}, params):
            tokens += len(out.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter() - start
        return tokens, first or 0.0

    async def client(i: int) -> int:
        own = prompts[i * w.requests_per_client : (i + 1) * w.requests_per_client]
        return sum([(await one(p))[0] for p in own])

    await one(prompts[0])  # warm-up
    ttfts = [(await one(prompts[i % len(prompts)]))[1] for i in range(w.ttft_repeats)]
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(client(i) for i in range(w.clients))))
    return Result(tokens, time.perf_counter() - start, statistics.median(ttfts))


def run_in_process(model: str, kwargs: dict[str, Any], w: Workload) -> tuple[Result, int]:
    from tinyvllm import AsyncLLM

    llm = AsyncLLM(model, **kwargs)
    try:
        vocab = llm.engine.config.model.vocab_size
        return asyncio.run(_in_process(llm, w, make_prompts(w, vocab))), vocab
    finally:
        llm.shutdown()


# ---- through the server ---------------------------------------------------------------------
async def _through_server(url: str, w: Workload, prompts: list[list[int]]) -> Result:
    httpx = _http()
    limits = httpx.Limits(max_connections=w.clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(prompt: list[int]) -> tuple[int, float]:
            body = {
                "model": SERVED_NAME,
                "prompt": prompt,
                "max_tokens": w.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            first, tokens = None, 0
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if first is None and event["choices"]:
                        first = time.perf_counter() - start
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            return tokens, first or 0.0

        async def client(i: int) -> int:
            own = prompts[i * w.requests_per_client : (i + 1) * w.requests_per_client]
            return sum([(await one(p))[0] for p in own])

        await one(prompts[0])
        ttfts = [(await one(prompts[i % len(prompts)]))[1] for i in range(w.ttft_repeats)]
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client(i) for i in range(w.clients))))
        return Result(tokens, time.perf_counter() - start, statistics.median(ttfts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float) -> None:
    httpx = _http()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tinyvllm serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"tinyvllm serve was not healthy after {timeout:.0f} s")


def run_server(model: str, flags: list[str], w: Workload, vocab: int) -> Result:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tinyvllm.cli", "serve", model, "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--uvicorn-log-level", "warning", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env)
    try:
        _wait_healthy(url, proc, timeout=600)
        return asyncio.run(_through_server(url, w, make_prompts(w, vocab)))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="as `tinyvllm serve` takes it (default: catalog)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-repeats", type=int, default=10)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quick", action="store_true", help="4 clients x 1 request x 8 tokens")
    p.add_argument("--out", default=None, help="also write the numbers as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tinyvllm.cli import resolve_cli_model

    if args.quick:
        args.clients, args.requests_per_client, args.max_tokens, args.ttft_repeats = 4, 1, 8, 3
    w = Workload(
        args.clients, args.requests_per_client, args.prompt_len, args.max_tokens, args.ttft_repeats
    )
    flags = ["--max-model-len", str(args.max_model_len), "--device", args.device]
    kwargs: dict[str, Any] = {"max_model_len": args.max_model_len, "device": args.device}
    if args.dtype:
        flags += ["--dtype", args.dtype]
        kwargs["dtype"] = args.dtype
    model, kwargs, label = resolve_cli_model(args.model, kwargs)
    print(f"model {label}; {w}", file=sys.stderr)
    local, vocab = run_in_process(model, kwargs, w)
    # The catalog's own engine arguments (dtype, quantization) travel with its name.
    served = run_server(args.model or label, flags, w, vocab)
    ratio = served.tok_s / local.tok_s
    overhead_ms = (served.ttft_median - local.ttft_median) * 1e3
    print("| path | tok/s | median TTFT (ms) |\n|---|---|---|")
    print(f"| AsyncLLM in-process | {local.tok_s:.1f} | {local.ttft_median * 1e3:.1f} |")
    print(f"| tinyvllm serve (HTTP, SSE) | {served.tok_s:.1f} | {served.ttft_median * 1e3:.1f} |")
    print(f"server / in-process: {ratio:.2f}x tok/s; TTFT overhead {overhead_ms:+.1f} ms")
    if args.out:
        report = {
            "model": label,
            "workload": asdict(w),
            "in_process": {**asdict(local), "tok_s": local.tok_s},
            "server": {**asdict(served), "tok_s": served.tok_s},
            "ratio": ratio,
            "ttft_overhead_ms": overhead_ms,
        }
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
