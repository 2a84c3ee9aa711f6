"""Soak: many random requests through AsyncLLM on a KV budget small enough to force preemption,
with random aborts and shared prefixes. Afterwards no block may be leaked, and every request
that ran to the end must have produced exactly its greedy tokens when run alone."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from tinyvllm import LLM, RequestOutput, RequestOutputKind, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM

# One intra-op thread: see the fixture in conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 96
MAX_PROMPT = 60
MAX_OUTPUT = 24
# 24 blocks of 16 tokens hold ~8 requests of average size, and any single one (<= 6 blocks).
SMALL_KV = {"num_gpu_blocks_override": 24, "block_size": 16}
KINDS = tuple(RequestOutputKind)
# Top-2 logprob gap under which the rounding of a different batch may flip a greedy pick (fp32
# differences are ~1e-6; the 10k soak meets gaps of ~2e-5).
TIE = 1e-3


@dataclass
class Job:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    kind: RequestOutputKind
    abort: str | None  # None | "id" (llm.abort after a delay) | "cancel" (task) | "break"
    abort_after: float  # seconds for "id"/"cancel", number of outputs for "break"
    outputs: list[RequestOutput] = field(default_factory=list)
    cancelled: bool = False

    def tokens(self) -> list[int]:
        if self.kind == RequestOutputKind.DELTA:
            return [t for out in self.outputs for t in out.outputs[0].token_ids]
        return list(self.outputs[-1].outputs[0].token_ids) if self.outputs else []

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished


def make_jobs(num_requests: int, num_prompts: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randint(16, 40))] for _ in range(3)]
    prompts: list[tuple[int, ...]] = []
    for i in range(num_prompts):
        if i % 3 == 0:  # a third share one of a few common prefixes (block-aligned or not)
            head = rng.choice(prefixes)
            tail = [rng.randrange(10, 1000) for _ in range(rng.randint(1, MAX_PROMPT - len(head)))]
            prompts.append(tuple(head + tail))
        else:
            prompts.append(
                tuple(rng.randrange(10, 1000) for _ in range(rng.randint(1, MAX_PROMPT)))
            )
    jobs = []
    for i in range(num_requests):
        abort = rng.choices([None, "id", "cancel", "break"], weights=[76, 8, 8, 8])[0]
        jobs.append(
            Job(
                request_id=f"soak-{i}",
                prompt=rng.choice(prompts),
                max_tokens=rng.randint(1, MAX_OUTPUT),
                kind=rng.choice(KINDS),
                abort=abort,
                abort_after=rng.randint(1, 3) if abort == "break" else rng.uniform(0.0, 0.3),
            )
        )
    return jobs


async def drive(llm: AsyncLLM, jobs: list[Job], seed: int, burst: bool = False) -> None:
    """Stream every job, with its abort; `burst` starts them all at once, else they arrive in
    random bursts while earlier ones run."""
    rng = random.Random(seed)

    async def consume(job: Job) -> None:
        params = SamplingParams(
            temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True, output_kind=job.kind
        )
        async for out in llm.generate(
            {"prompt_token_ids": list(job.prompt)}, params, job.request_id
        ):
            job.outputs.append(out)
            if job.abort == "break" and len(job.outputs) >= job.abort_after:
                break

    async def abort_later(job: Job, task: asyncio.Task[None]) -> None:
        await asyncio.sleep(job.abort_after)
        if job.abort == "id":
            await llm.abort(job.request_id)
        elif not task.done():
            job.cancelled = True
            task.cancel()

    tasks: list[asyncio.Task[None]] = []
    i = 0
    while i < len(jobs):
        for job in jobs[i : len(jobs) if burst else i + rng.randint(1, 40)]:
            task = asyncio.create_task(consume(job))
            tasks.append(task)
            if job.abort in ("id", "cancel"):
                tasks.append(asyncio.create_task(abort_later(job, task)))
            i += 1
        await asyncio.sleep(rng.uniform(0.0, 0.02))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(e, asyncio.CancelledError) for e in errors), errors[:3]


@dataclass
class Reference:
    """A prompt's greedy tokens alone, with the gap between the top two logprobs at each."""

    tokens: list[int]
    gaps: list[float]

    def agrees(self, tokens: list[int]) -> bool:
        """`tokens` is a prefix of the reference, or leaves it only at a near-tie: there the
        batch a request ran in may round either way, and the rest legitimately differs."""
        for i, (got, want) in enumerate(zip(tokens, self.tokens, strict=False)):
            if got != want:
                return self.gaps[i] < TIE
        return len(tokens) <= len(self.tokens)


def reference_tokens(model: str, jobs: list[Job]) -> dict[tuple[int, ...], Reference]:
    """Each distinct prompt alone (a batch of one, ample KV, no prefix cache), for as many
    tokens as any request asked of it: a greedy run for fewer tokens is a prefix of it."""
    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN)
    longest: dict[tuple[int, ...], int] = {}
    for job in jobs:
        longest[job.prompt] = max(longest.get(job.prompt, 0), job.max_tokens)
    refs = {}
    for prompt, n in longest.items():
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        out = llm.generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)
        completion = out[0].outputs[0]
        gaps = []
        for entry in completion.logprobs or []:
            top = sorted((lp.logprob for lp in entry.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        refs[prompt] = Reference(completion.token_ids, gaps)
    return refs


def soak(
    model: str, num_requests: int, num_prompts: int, seed: int = 0, burst: bool = False
) -> None:
    jobs = make_jobs(num_requests, num_prompts, seed)
    llm = AsyncLLM(
        model,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        **SMALL_KV,
    )
    try:
        run = drive(llm, jobs, seed, burst)
        asyncio.run(asyncio.wait_for(run, timeout=60 + num_requests * 0.5))
    finally:
        llm.shutdown(drain=True, timeout=60)

    engine = llm.engine
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"
    assert all(c == 0 for c in pool.ref_counts), "a block still has references"
    pool.check_invariants()
    assert not engine.parents and not engine.scheduler.has_unfinished_requests()
    assert not engine.output_processor.children and len(engine.runner.states) == 0

    refs = reference_tokens(model, jobs)
    finals = [job.outputs[-1] for job in jobs if job.finished]
    num_aborted = 0
    for job in jobs:
        tokens = job.tokens()
        assert refs[job.prompt].agrees(tokens), (job.request_id, tokens, refs[job.prompt])
        reason = job.outputs[-1].outputs[0].finish_reason if job.finished else None
        if reason == "length":
            assert len(tokens) == job.max_tokens, job.request_id
        else:  # aborted one way or another, so the tokens above were a prefix
            assert job.abort is not None and reason in (None, "abort"), (job.request_id, reason)
            num_aborted += 1
    assert num_aborted > 0, "no abort landed mid-request"
    assert sum(out.metrics.num_preemptions for out in finals) > 0, "the KV budget never bit"
    assert sum(out.num_cached_tokens for out in finals) > 0, "no prefix-cache hit"


def test_soak_500_requests(tiny_models) -> None:
    soak(str(tiny_models["llama"]), num_requests=500, num_prompts=40)


def test_soak_300_concurrent_streams(tiny_models) -> None:
    # All at once: 300 streams queue on a KV cache that holds ~8 of them, and the aborts and
    # cancels land on waiting, running and preempted requests alike.
    soak(str(tiny_models["llama"]), num_requests=300, num_prompts=30, seed=2, burst=True)


@pytest.mark.slow
def test_soak_10k_requests(tiny_models) -> None:
    soak(str(tiny_models["llama"]), num_requests=10_000, num_prompts=300, seed=1)
