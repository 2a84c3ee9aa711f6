"""Turns per-step token updates into RequestOutputs: detokenization, stop strings, logprobs,
metrics, and fan-in of `n > 1` child requests into one parent output."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tinyvllm.engine.detokenizer import IncrementalDetokenizer, decode_token, special_token_ids
from tinyvllm.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

LogprobEntry = tuple[list[int], list[float], int]


@dataclass(eq=False)
class ChildState:
    """Output-side state of one sequence (a request, or one of a parent's `n` samples)."""

    request_id: str
    parent: ParentState
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA streams
    changed: bool = False


@dataclass(eq=False)
class ParentState:
    """What the user sees as one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer) if tokenizer is not None else None
        self.children: dict[str, ChildState] = {}

    def add(
        self, parent: ParentState, child_ids: list[str], child_params: list[SamplingParams]
    ) -> None:
        for index, (rid, params) in enumerate(zip(child_ids, child_params, strict=True)):
            child = ChildState(
                request_id=rid,
                parent=parent,
                index=index,
                params=params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, parent.prompt_token_ids, params, special_ids=self.special_ids
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            parent.children.append(child)
            self.children[rid] = child
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]

    def reseed(self, parent: ParentState) -> None:
        """The prompt grew (streaming input) before any output: detokenize against it."""
        for child in parent.children:
            assert not child.token_ids, "a prompt cannot grow once output exists"
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer, parent.prompt_token_ids, child.params, special_ids=self.special_ids
            )

    def add_prompt_logprobs(self, request_id: str, entries: list[LogprobEntry]) -> None:
        child = self.children.get(request_id)
        if child is None or child.index != 0 or child.parent.prompt_logprobs is None:
            return  # n > 1 children share a prompt; the first one reports it
        child.parent.prompt_logprobs.extend(self._to_logprob_dicts(entries))

    def on_tokens(
        self,
        request_id: str,
        new_token_ids: list[int],
        logprobs: list[LogprobEntry] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        now: float,
    ) -> str | None:
        """Record new tokens. Returns the stop string that ended the sequence, if one did."""
        child = self.children[request_id]
        metrics = child.parent.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_generation_tokens += len(new_token_ids)
        child.token_ids.extend(new_token_ids)
        child.changed = True
        if logprobs is not None and child.logprobs is not None:
            for entry in logprobs:
                child.cumulative_logprob = (child.cumulative_logprob or 0.0) + entry[1][0]
            child.logprobs.extend(self._to_logprob_dicts(logprobs))
        stop_string = child.detokenizer.update(
            new_token_ids,
            finished=finish_reason is not None,
            stop_terminated=finish_reason == "stop",
        )
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
        if finish_reason is not None:
            self.finish(request_id, finish_reason, stop_reason, now)
        return stop_string

    def finish(
        self,
        request_id: str,
        finish_reason: str,
        stop_reason: int | str | None = None,
        now: float | None = None,
        error: str | None = None,
    ) -> None:
        child = self.children.get(request_id)
        if child is None or child.finish_reason is not None:
            return
        if finish_reason != "error":
            # Ended without a last token update (a realtime request whose input ends after
            # its last token, an abort): the bytes of an incomplete character still flush as
            # U+FFFD, so the text equals a full decode of the tokens.
            try:
                child.detokenizer.update([], finished=True)
            except Exception as exc:  # a tokenizer that cannot decode: this request errs
                finish_reason, error = "error", f"{type(exc).__name__}: {exc}"
        child.finish_reason = finish_reason
        child.stop_reason = stop_reason
        child.changed = True
        if error is not None:
            child.parent.error = error
        if child.parent.finished:
            child.parent.metrics.finished_time = now if now is not None else time.monotonic()

    def make_output(self, parent: ParentState) -> RequestOutput | None:
        """The RequestOutput to hand out now for `parent`, or None if its kind says wait."""
        kind = parent.params.output_kind
        finished = parent.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        changed = [c for c in parent.children if c.changed]
        if not changed:
            return None
        children = changed if kind == RequestOutputKind.DELTA else parent.children
        outputs = [self._completion(c, delta=kind == RequestOutputKind.DELTA) for c in children]
        for c in changed:
            c.changed = False
        if finished:
            for c in parent.children:
                self.children.pop(c.request_id, None)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.metrics.num_cached_tokens,
            error=parent.error,
        )

    def _completion(self, child: ChildState, delta: bool) -> CompletionOutput:
        finished = child.finish_reason is not None
        text = child.detokenizer.get_next_output_text(finished, delta)
        if delta:
            start = child.num_sent_tokens
            child.num_sent_tokens = len(child.token_ids)
            token_ids = child.token_ids[start:]
            logprobs = None if child.logprobs is None else child.logprobs[start:]
        else:
            token_ids = list(child.token_ids)
            logprobs = None if child.logprobs is None else list(child.logprobs)
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=child.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )

    def _to_logprob_dicts(self, entries: list[LogprobEntry]) -> list[dict[int, Logprob]]:
        out = []
        for ids, values, rank in entries:
            d: dict[int, Logprob] = {}
            for j, (tok, lp) in enumerate(zip(ids, values, strict=True)):
                if tok in d:
                    continue  # the sampled token may also be among the top-N
                d[tok] = Logprob(
                    logprob=lp,
                    rank=rank if j == 0 else j,
                    # Without a tokenizer (skip_tokenizer_init) vLLM leaves this None too.
                    decoded_token=(
                        None if self.tokenizer is None else decode_token(self.tokenizer, tok)
                    ),
                )
            out.append(d)
        return out
