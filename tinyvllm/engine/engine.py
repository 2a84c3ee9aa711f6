"""Engine: add_request / abort / step. One step = schedule -> run the model -> process outputs."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Container, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyvllm.config import EngineArgs, EngineConfig
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.audio_inputs import output_limit
from tinyvllm.engine.output_processor import OutputProcessor, ParentState
from tinyvllm.engine.stats import StatsCollector
from tinyvllm.outputs import RequestMetrics, RequestOutput
from tinyvllm.request import MultiModalFeature, Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.stats import EngineStats

if TYPE_CHECKING:
    from tinyvllm.runner.kv_cache import KVCacheSize

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]


class Engine:
    """The synchronous engine core. Not thread-safe: one thread drives it."""

    # What `LLM` / `AsyncLLM` may ask of it: generate (PoolingEngine: "pooling").
    runner_type = "generate"

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        from tinyvllm.runner.model_runner import ModelRunner
        from tinyvllm.utils.device import resolve_device, resolve_dtype

        self.tokenizer = tokenizer
        device = resolve_device(config.device.device)
        dtype = resolve_dtype(config.model.dtype)
        self.runner = ModelRunner(config, dtype, device)
        kv_size = self.runner.initialize_kv_cache()
        self.config = config = _fit_to_kv_cache(config, kv_size)
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
        self.eos_token_id: int | None = _eos_token_id(config, tokenizer)
        self.extra_stop_ids = _generation_config_eos(config, self.eos_token_id)
        self.stats = StatsCollector()
        from tinyvllm.engine.mm_inputs import create_mm_processor

        mc = config.model
        self.mm_processor = create_mm_processor(
            mc.hf_config, mc.model_path, mc.max_model_len, mc.video_pruning_rate, tokenizer
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
    ) -> str:
        """Validate and queue a request; raises ValueError naming the problem on bad input."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = self._new_request_id(request_id)
        prompt_text, prompt_ids = self._tokenize(prompt)
        prompt_ids, mm_features = self._multimodal(prompt, prompt_ids)
        self._validate_prompt(prompt_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()

        max_model_len = self.config.model.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
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
                self.scheduler.add_request(
                    Request(
                        request_id=rid,
                        prompt_token_ids=prompt_ids,
                        sampling_params=p,
                        eos_token_id=self.eos_token_id,
                        max_tokens=max_tokens,
                        arrival_time=arrival,
                        mm_features=mm_features,
                    )
                )
        except BaseException:
            self._forget(request_id, child_ids)
            raise
        return request_id

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
        kv = self.kv_cache_manager.stats()
        self.stats.record_prefix_counters(kv.prefix_queries, kv.prefix_hits)
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


def claim_request_id(request_id: str | None, in_use: Container[str], counter: Iterator[int]) -> str:
    """`request_id` checked to be a free str, or (None) the next free number from `counter`."""
    if request_id is None:
        request_id = str(next(counter))
        while request_id in in_use:  # a caller chose this one
            request_id = str(next(counter))
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if request_id in in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    return request_id


def tokenize_prompt(
    tokenizer: Any, prompt: PromptType, truncate_to: int | None = None
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids). With `truncate_to` at most that many tokens are kept:
    text is truncated by the tokenizer (its truncation side, special tokens kept), token ids
    keep the last `truncate_to` (vLLM's rule)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer, but the engine was started with "
                "skip_tokenizer_init=True; pass {'prompt_token_ids': [...]} instead"
            )
        text = check_text(prompt)
        if truncate_to is None:
            return prompt, list(tokenizer.encode(text))
        return prompt, list(tokenizer.encode(text, truncation=True, max_length=truncate_to))
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            return prompt.get("prompt"), ids if truncate_to is None else ids[-truncate_to:]
        if "prompt" in prompt:
            return tokenize_prompt(tokenizer, prompt["prompt"], truncate_to)
        raise ValueError(
            f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
        )
    if isinstance(prompt, list | tuple):
        return None, list(prompt) if truncate_to is None else list(prompt)[-truncate_to:]
    raise TypeError(
        f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}"
    )


def check_token_ids(prompt_ids: list[int], vocab: int) -> None:
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"prompt_token_ids contains out-of-vocabulary id(s) {bad[:5]}; "
            f"valid ids are 0..{vocab - 1}"
        )


def child_request_id(request_id: str, index: int) -> str:
    """The internal id of sample `index` of a request (its only sequence when n = 1).

    Every sequence gets one, so no user id can equal another request's internal id: the part
    after the last '#' is always the index, which makes the mapping one-to-one.
    """
    return f"{request_id}#{index}"


def check_text(text: str, what: str = "the prompt") -> str:
    """`text` if UTF-8 can encode it, else ValueError. Lone surrogates (undecodable bytes read
    with errors="surrogateescape", or a broken escape) would reach the tokenizer as a bare
    TypeError about TextEncodeInput."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise ValueError(
            f"{what} is not valid Unicode text: {bad!r} at character {exc.start} is a lone "
            "surrogate, which UTF-8 cannot encode (often undecodable bytes in the input); "
            "remove it or decode the input with errors='replace'"
        ) from None
    return text


def _fit_to_kv_cache(config: EngineConfig, kv_size: KVCacheSize) -> EngineConfig:
    """The config the engine serves with: `config` with the context the KV cache allows and,
    for a hybrid model, no more running requests than it has state slots (the caller's config
    is left as it was)."""
    max_model_len = kv_size.max_model_len
    max_num_seqs = config.scheduler.max_num_seqs
    if kv_size.num_running_states:
        max_num_seqs = min(max_num_seqs, kv_size.num_running_states)
    if (
        max_model_len == config.model.max_model_len == config.scheduler.max_model_len
        and max_num_seqs == config.scheduler.max_num_seqs
    ):
        return config
    return replace(
        config,
        model=replace(config.model, max_model_len=max_model_len),
        scheduler=replace(config.scheduler, max_model_len=max_model_len, max_num_seqs=max_num_seqs),
    )


def _eos_token_id(config: EngineConfig, tokenizer: Any) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(config.model.hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


def _generation_config_eos(config: EngineConfig, eos: int | None) -> set[int]:
    """EOS ids from generation_config.json besides the tokenizer's (e.g. Llama 3's <|eot_id|>)."""
    # Read as plain JSON: transformers' GenerationConfig costs a second of imports.
    file = Path(config.model.model_path) / "generation_config.json"
    try:
        ids = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # absent (a GGUF file), unreadable, not a dict
        return set()
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    if not isinstance(ids, list):
        return set()
    found = {i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0}
    return found - ({eos} if eos is not None else set())
