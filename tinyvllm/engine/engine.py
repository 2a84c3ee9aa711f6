"""Engine: add_request / abort / step. One step = schedule -> run the model -> process outputs."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Any

from tinyvllm.config import EngineArgs, EngineConfig
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.input_streams import InputStreams
from tinyvllm.engine.output_processor import OutputProcessor, ParentState
from tinyvllm.engine.prompts import (  # noqa: F401  (re-exported: the engine's input API)
    PromptType,
    check_text,
    check_token_ids,
    child_request_id,
    claim_request_id,
    tokenize_prompt,
)
from tinyvllm.engine.setup import (
    eos_token_id,
    fit_to_kv_cache,
    generation_config_eos,
    resolve_tokenizer,
)
from tinyvllm.engine.stats import StatsCollector
from tinyvllm.outputs import RequestMetrics, RequestOutput
from tinyvllm.request import MultiModalFeature, Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.stats import EngineStats

logger = logging.getLogger(__name__)


class Engine:
    """The synchronous engine core. Not thread-safe: one thread drives it."""

    # What `LLM` / `AsyncLLM` may ask of it: generate (PoolingEngine: "pooling").
    runner_type = "generate"

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        from tinyvllm.runner.model_runner import ModelRunner
        from tinyvllm.utils.device import resolve_device, resolve_dtype

        device = resolve_device(config.device.device)
        dtype = resolve_dtype(config.model.dtype)
        self.runner = ModelRunner(config, dtype, device)
        kv_size = self.runner.initialize_kv_cache()
        self.tokenizer = tokenizer = resolve_tokenizer(tokenizer)
        self.config = config = fit_to_kv_cache(config, kv_size)
        caching = config.cache.enable_prefix_caching
        if kv_size.num_running_states and not config.cache.caches_state_snapshots:
            # A hybrid model resumes a prefix only from a state snapshot: none, no hits.
            caching = False
        self.kv_cache_manager = KVCacheManager(
            kv_size.num_blocks,
            kv_size.block_size,
            caching,
            kv_size.num_running_states,
            kv_size.num_snapshot_states,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.output_processor = OutputProcessor(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._counter = itertools.count()
        self.eos_token_id: int | None = eos_token_id(config, tokenizer)
        self.extra_stop_ids = generation_config_eos(config, self.eos_token_id)
        self.stats = StatsCollector()
        from tinyvllm.engine.mm_inputs import create_mm_processor

        mc = config.model
        self.mm_processor = create_mm_processor(
            mc.hf_config, mc.model_path, mc.max_model_len, mc.video_pruning_rate, tokenizer
        )
        self.input_streams = InputStreams(
            tokenizer, self.mm_processor, self.output_processor, mc.max_model_len, mc.vocab_size
        )
        # Whether the latest step scheduled nothing: the same state would schedule nothing
        # again, so a driver should wait for new requests or aborts rather than step again.
        self.last_step_empty = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> Engine:
        from tinyvllm.engine.factory import create_engine

        engine = create_engine(args)
        if not isinstance(engine, cls):
            raise ValueError(
                f"{args.model!r} resolved to runner={engine.runner_type!r}, which Engine cannot "
                "run; use tinyvllm.engine.factory.create_engine (as LLM does)"
            )
        return engine

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        streaming: bool = False,
    ) -> str:
        """Validate and queue a request; raises ValueError naming the problem on bad input.

        `streaming`: `prompt` is the first chunk of the request's input; more come through
        `append_input` until `end_input` (see tinyvllm/engine/input_streams.py)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if streaming and params.n != 1:
            raise ValueError(
                f"a streaming-input request takes n=1 (one sequence), got n={params.n}; run "
                "one stream per sample"
            )
        request_id = self._new_request_id(request_id)
        if streaming:
            prompt = self.input_streams.first_chunk(prompt)
        prompt_text, prompt_ids = self._tokenize(prompt)
        prompt_ids, mm_features = self._multimodal(prompt, prompt_ids)
        self._validate_prompt(prompt_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()

        max_model_len = self.config.model.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        # Here, not at module level: audio_inputs loads torch, which `import tinyvllm` must not.
        from tinyvllm.engine.audio_inputs import output_limit
        from tinyvllm.multimodal.audio_stream import audio_stream_of

        audio_limit = output_limit(mm_features, len(prompt_ids))
        if audio_limit is not None:  # realtime speech: one token per audio position
            max_tokens = min(max_tokens, audio_limit)
        if self.extra_stop_ids and not params.ignore_eos:
            stop_ids = sorted(set(params.stop_token_ids or []) | self.extra_stop_ids)
            params = replace(params, stop_token_ids=stop_ids)
        child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        if params.n == 1:
            child_params = [params]
        else:
            child_params = [
                replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                for i in range(params.n)
            ]
        parent = ParentState(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(prompt_ids)),
        )
        # Everything was checked above; should registering still fail part-way, undo it all, so
        # no half-added request is left that could never finish.
        self.parents[request_id] = parent
        try:
            self.output_processor.add(parent, child_ids, child_params)
            for rid, p in zip(child_ids, child_params, strict=True):
                self._child_to_parent[rid] = request_id
                request = Request(
                    request_id=rid,
                    prompt_token_ids=prompt_ids,
                    sampling_params=p,
                    eos_token_id=self.eos_token_id,
                    max_tokens=max_tokens,
                    arrival_time=arrival,
                    mm_features=mm_features,
                    # A realtime model's positions wait for their audio.
                    input_gate=audio_stream_of(mm_features),
                )
                if streaming:
                    self.input_streams.start(parent, request)
                self.scheduler.add_request(request)
        except BaseException:
            self._forget(request_id, child_ids)
            raise
        return request_id

    def append_input(self, request_id: str, prompt: PromptType) -> None:
        """Append one input chunk to a streaming request (ValueError: the chunk is refused and
        the request left as it was; the caller decides whether it fails)."""
        self.input_streams.append(request_id, prompt)

    def end_input(self, request_id: str) -> list[RequestOutput]:
        """A streaming request's input is complete: it generates to its end. Returns its final
        output when that end is reached already (a realtime request whose audio is all
        transcribed)."""
        request = self.input_streams.end(request_id)
        if request.num_output_tokens < request.max_tokens:
            return []
        self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_LENGTH_CAPPED)
        self.output_processor.finish(request.request_id, "length")
        return self._collect({request_id: self.parents[request_id]})

    def fail_request(self, request_id: str, message: str) -> list[RequestOutput]:
        """End a request with an error (finish_reason "error"): its final outputs."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        touched: dict[str, ParentState] = {}
        self._fail([c.request_id for c in parent.children], message, touched)
        return self._collect(touched)

    @property
    def awaiting_input(self) -> bool:
        """Whether a streaming request waits for input: an empty step is then no deadlock."""
        return self.input_streams.awaiting_input

    def _new_request_id(self, request_id: str | None) -> str:
        return claim_request_id(request_id, self.parents, self._counter)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is not None:
                # A stopped request still counts as one; its cut-short latency is no e2e sample.
                self.stats.record_finished(None)
                self._forget(rid, [c.request_id for c in parent.children])

    abort = abort_request

    def _forget(self, request_id: str, child_ids: list[str]) -> None:
        """Drop a request from the engine, wherever it got to (frees its blocks)."""
        self.parents.pop(request_id, None)
        self.input_streams.forget(request_id)
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        for cid in child_ids:
            self._child_to_parent.pop(cid, None)
            self.output_processor.children.pop(cid, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. after swapping weights); True when done."""
        self.kv_cache_manager.reset_prefix_cache()
        return True

    def get_stats(self, include_blocks: bool = False) -> EngineStats:
        """A consistent-enough snapshot for monitoring; safe to call from any thread."""
        kv = self.kv_cache_manager.stats(include_blocks)
        return self.stats.snapshot(kv, self.scheduler.stats())

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.parents)

    def aborted_output(self, request_id: str) -> RequestOutput | None:
        """The final output of a request being aborted: what it generated so far, with
        finish_reason "abort" (None for an unknown id). The caller then aborts it."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            self.output_processor.finish(child.request_id, "abort")
        return self.output_processor.make_output(parent)

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return outputs for requests that changed (per output_kind)."""
        sched = self.scheduler.schedule()
        self.last_step_empty = sched.is_empty
        now = time.monotonic()
        for new in sched.scheduled_new_reqs:
            metrics = self.parents[self._child_to_parent[new.req_id]].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = new.num_computed_tokens
        # The counters alone: the full stats() would also build the pool's, every step.
        counters = self.kv_cache_manager.counters
        self.stats.record_prefix_counters(counters.queries, counters.hits)
        prompt_tokens = self._prompt_tokens_scheduled(sched.num_scheduled_tokens)
        touched: dict[str, ParentState] = {}
        try:
            runner_out = self.runner.execute_model(sched)
        except Exception as exc:  # one bad step must not take the engine down
            logger.exception("model step failed")
            failed = list(sched.num_scheduled_tokens)
            self._fail(failed, f"model step failed: {type(exc).__name__}: {exc}", touched)
            return self._collect(touched)

        if runner_out.num_speculative_tokens is not None:
            self.stats.record_spec_k(runner_out.num_speculative_tokens)
        for rid, message in runner_out.failed.items():
            # Before the scheduler takes the step's output, which then skips these requests.
            self._fail([rid], message, touched)
        for rid, entries in runner_out.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(rid, entries)
        logprobs_by_req = dict(zip(runner_out.req_ids, runner_out.logprobs or [], strict=False))
        now = time.monotonic()
        num_generated = 0
        for update in self.scheduler.update_from_output(sched, runner_out):
            request = update.request
            rid = request.request_id
            parent = self.parents[self._child_to_parent[rid]]
            touched[parent.request_id] = parent
            num_generated += len(update.new_token_ids)
            if rid in runner_out.spec_counts:
                drafted, accepted = runner_out.spec_counts[rid]
                parent.metrics.num_draft_tokens += drafted
                parent.metrics.num_accepted_tokens += accepted
            self._record_token_times(parent, len(update.new_token_ids), now)
            finish_reason = request.status.finish_reason if update.finished else None
            try:
                stop_string = self.output_processor.on_tokens(
                    rid,
                    update.new_token_ids,
                    logprobs_by_req.get(rid),
                    finish_reason,
                    request.stop_reason,
                    now,
                )
            except Exception as exc:  # e.g. a tokenizer that cannot decode: fail this one only
                logger.exception("output processing failed for %s", rid)
                self._fail([rid], f"{type(exc).__name__}: {exc}", touched)
                continue
            if stop_string is not None and not update.finished:
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
            parent.metrics.num_preemptions = max(
                parent.metrics.num_preemptions, request.num_preemptions
            )
        if runner_out.spec_counts:
            counts = runner_out.spec_counts.values()
            self.stats.record_spec(
                sum(d for d, _ in counts), sum(a for _, a in counts), len(counts)
            )
        if not sched.is_empty:  # an empty step only lets the runner drop finished rows
            self.stats.record_step(
                now, prompt_tokens, num_generated, sched.total_num_scheduled_tokens
            )
        return self._collect(touched)

    def _prompt_tokens_scheduled(self, num_scheduled: dict[str, int]) -> int:
        """Scheduled tokens that are prompt (prefill) rather than the one-token decode input."""
        requests = self.scheduler.requests
        total = 0
        for rid, n in num_scheduled.items():
            request = requests[rid]
            start = request.num_computed_tokens - n
            total += max(0, min(n, request.num_prompt_tokens - start))
        return total

    def _record_token_times(self, parent: ParentState, num_new: int, now: float) -> None:
        if num_new == 0:
            return
        metrics = parent.metrics
        if metrics.first_token_time is None:
            self.stats.record_tokens(now - metrics.arrival_time, [])
            num_new -= 1
        if num_new and metrics.last_token_time is not None:
            gap = (now - metrics.last_token_time) / num_new
            self.stats.record_tokens(None, [gap] * num_new)

    def _fail(self, request_ids: list[str], message: str, touched: dict[str, ParentState]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        for rid in request_ids:
            parent = self.parents.get(self._child_to_parent.get(rid, ""))
            if parent is None:
                continue
            self.output_processor.finish(rid, "error", error=message)
            touched[parent.request_id] = parent

    def _collect(self, touched: dict[str, ParentState]) -> list[RequestOutput]:
        outputs = []
        for parent in touched.values():
            out = self.output_processor.make_output(parent)
            if parent.finished:
                self.stats.record_finished(parent.metrics.e2e_latency)
                self.parents.pop(parent.request_id, None)
                self.input_streams.forget(parent.request_id)
                for c in parent.children:
                    self._child_to_parent.pop(c.request_id, None)
            if out is not None:
                outputs.append(out)
        return outputs

    # ---- input handling ------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def _multimodal(
        self, prompt: PromptType, prompt_ids: list[int]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's media as placeholder spans (the placeholders expanded to their size)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            self.mm_processor.check_text_prompt(prompt_ids)
            return prompt_ids, []
        return self.mm_processor.process(prompt_ids, data)

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: pass at least one token")
        max_len = self.config.model.max_model_len
        if len(prompt_ids) > max_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, longer than max_model_len={max_len}; "
                "shorten it or raise max_model_len"
            )
        check_token_ids(prompt_ids, self.config.model.vocab_size)
