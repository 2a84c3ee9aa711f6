"""PoolingEngine: the engine of a pooling (embedding) model, with Engine's driving interface
(add_request / abort_request / step), so LLM, AsyncLLM and the engine loop run it unchanged.

A pooling request is one forward over its whole prompt, so there is no KV cache, no decode and
no preemption: requests wait first come, first served, and each step runs as many of them as
fit the token budget (max_num_batched_tokens, max_num_seqs) in one batch and finishes them all.
Requests that arrive while a step runs (AsyncLLM callers) batch together in the next one.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.core.block_pool import BlockPoolStats
from tinyvllm.core.kv_cache_manager import KVCacheStats
from tinyvllm.core.scheduler import SchedulerStats
from tinyvllm.engine.engine import PromptType, check_token_ids, claim_request_id, tokenize_prompt
from tinyvllm.engine.setup import resolve_tokenizer
from tinyvllm.engine.stats import StatsCollector
from tinyvllm.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.stats import EngineStats

logger = logging.getLogger(__name__)

NOT_GENERATIVE = (
    "this engine runs {model!r} as a pooling model (runner='pooling'): it computes "
    "embeddings, not text; use embed() or encode(), or create the engine with "
    "runner='generate' for a model that can generate"
)


@dataclass
class _Waiting:
    request_id: str
    prompt_token_ids: list[int]
    task: str
    normalize: bool
    metrics: RequestMetrics


class PoolingEngine:
    """Not thread-safe: one thread drives it (as Engine)."""

    runner_type = "pooling"

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        from tinyvllm.runner.pooling_runner import PoolingRunner
        from tinyvllm.utils.device import resolve_device, resolve_dtype

        self.config = config
        device = resolve_device(config.device.device)
        self.runner = PoolingRunner(config, resolve_dtype(config.model.dtype), device)
        self.tokenizer = resolve_tokenizer(tokenizer)
        self.waiting: dict[str, _Waiting] = {}  # FCFS: dicts keep insertion order
        self._counter = itertools.count()
        self.stats = StatsCollector()
        self.last_step_empty = False

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: PoolingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate, tokenize (and truncate) and queue a request; ValueError on bad input."""
        if isinstance(params, SamplingParams):
            raise ValueError(NOT_GENERATIVE.format(model=self.config.model.model))
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"params must be PoolingParams, got {type(params).__name__}")
        request_id = claim_request_id(request_id, self.waiting, self._counter)
        max_len = self.config.model.max_model_len
        truncate = params.truncate_prompt_tokens
        if truncate is not None and (truncate == -1 or truncate > max_len):
            truncate = max_len
        _, prompt_ids = tokenize_prompt(self.tokenizer, prompt, truncate)
        if not prompt_ids:
            raise ValueError("the prompt is empty: pass at least one token")
        if len(prompt_ids) > max_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, more than this model's "
                f"max_model_len={max_len} positions; pass truncate_prompt_tokens={max_len} (or "
                "-1) to keep as many tokens as fit, or shorten the prompt"
            )
        check_token_ids(prompt_ids, self.config.model.vocab_size)
        pooler = self.config.model.pooler_config
        assert pooler is not None and pooler.normalize is not None
        task = params.task or "embed"
        # Raw hidden states unless asked (LLM.encode); embeddings as the model's pooler says.
        default = pooler.normalize if task == "embed" else False
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self.waiting[request_id] = _Waiting(
            request_id,
            prompt_ids,
            task,
            default if params.normalize is None else params.normalize,
            RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(prompt_ids)),
        )
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.waiting.pop(rid, None) is not None:
                self.stats.record_finished(None)

    abort = abort_request

    def aborted_output(self, request_id: str) -> PoolingRequestOutput[Any] | None:
        """The final output of a request being aborted (no result), None for an unknown id."""
        request = self.waiting.get(request_id)
        if request is None:
            return None
        return PoolingRequestOutput(request_id, None, request.prompt_token_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is cached between requests

    def get_stats(self, include_blocks: bool = False) -> EngineStats:
        """Queue, throughput and latency numbers (a pooling model has no KV cache: zero
        blocks)."""
        kv = KVCacheStats(BlockPoolStats(0, 0, 0, 0), 1, False, 0, 0)
        return self.stats.snapshot(kv, SchedulerStats(0, len(self.waiting), 0, 0))

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[PoolingRequestOutput[Any]]:
        """Run the requests that fit one batch; every one of them finishes here."""
        batch = self._schedule()
        self.last_step_empty = not batch
        if not batch:
            return []
        start = time.monotonic()
        for request in batch:
            self.waiting.pop(request.request_id)
            request.metrics.first_scheduled_time = start
        from tinyvllm.runner.pooling_runner import PoolingInput

        inputs = [PoolingInput(r.prompt_token_ids, r.task, r.normalize) for r in batch]
        try:
            results = self.runner.execute(inputs)
        except Exception as exc:  # one bad batch must not take the engine down
            logger.exception("pooling step failed")
            error = f"model step failed: {type(exc).__name__}: {exc}"
            return [self._finish(r, None, error) for r in batch]
        num_tokens = sum(len(r.prompt_token_ids) for r in batch)
        self.stats.record_step(time.monotonic(), num_tokens, 0, num_tokens)
        return [
            self._finish(r, PoolingOutput(data), None)
            for r, data in zip(batch, results, strict=True)
        ]

    def _schedule(self) -> list[_Waiting]:
        sched = self.config.scheduler
        budget = sched.max_num_batched_tokens
        batch: list[_Waiting] = []
        for request in self.waiting.values():
            if len(batch) == sched.max_num_seqs or len(request.prompt_token_ids) > budget:
                break  # first come, first served: nobody overtakes the head of the queue
            batch.append(request)
            budget -= len(request.prompt_token_ids)
        return batch

    def _finish(
        self, request: _Waiting, output: PoolingOutput | None, error: str | None
    ) -> PoolingRequestOutput[Any]:
        metrics = request.metrics
        metrics.finished_time = time.monotonic()
        self.stats.record_finished(metrics.e2e_latency)
        return PoolingRequestOutput(
            request.request_id,
            output,
            request.prompt_token_ids,
            metrics=metrics,
            error=error,
        )
