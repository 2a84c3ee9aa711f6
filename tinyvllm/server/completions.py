"""POST /v1/completions: one or more prompts, `n` choices each (choice index
`prompt_index * n + i`, as OpenAI numbers them), streamed or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from tinyvllm.server.sampling import (
    completion_sampling,
    extend_completion_logprobs,
    prompt_logprobs_json,
)
from tinyvllm.server.serving import (
    ServerState,
    collect,
    engine_prompts,
    event_stream,
    merged,
    new_id,
    run_request,
    sse,
    unless_disconnected,
)


async def _tokenized(state: ServerState, prompts: list[Any]) -> list[Any]:
    """Text prompts as token ids without special tokens (add_special_tokens=false)."""
    tokenizer = state.tokenizer

    def encode(text: str) -> dict[str, Any]:
        return {
            "prompt": text,
            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
        }

    return [await asyncio.to_thread(encode, p) if isinstance(p, str) else p for p in prompts]


async def create_completion(
    state: ServerState, req: CompletionRequest, raw: Request
) -> CompletionResponse | StreamingResponse:
    state.check_generative(req.model)
    params = completion_sampling(req, state.sampling_defaults)
    prompts = engine_prompts(req.prompt, "prompt")
    if not req.add_special_tokens:
        prompts = await _tokenized(state, prompts)
    request_id = req.request_id or new_id("cmpl")
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    streams = [run_request(state, p, params, rid) for p, rid in zip(prompts, ids, strict=True)]
    if req.stream:
        return await event_stream(_stream(state, req, request_id, params, streams), raw)

    async def run_all() -> list[Any]:
        return await asyncio.gather(*(collect(s, params.n) for s in streams))

    results = await unless_disconnected(raw, run_all())
    choices, usage = [], UsageInfo()
    for p_index, (last, parts) in enumerate(results):
        usage.prompt_tokens += len(last.prompt_token_ids)
        prefix = _echo(state, req, last)
        prompt_logprobs = prompt_logprobs_json(last.prompt_logprobs)
        for i, part in enumerate(parts):
            usage.completion_tokens += len(part.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                extend_completion_logprobs(
                    logprobs, part.token_ids, part.logprobs, req.logprobs, len(prefix)
                )
            choices.append(
                CompletionChoice(
                    index=p_index * params.n + i,
                    text=prefix + part.text,
                    logprobs=logprobs,
                    finish_reason=part.finish_reason,
                    stop_reason=part.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                )
            )
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage)


def _echo(state: ServerState, req: CompletionRequest, out: RequestOutput) -> str:
    """The prompt's text when the request asks for it back (token ids are decoded)."""
    if not req.echo:
        return ""
    if out.prompt is not None:
        return out.prompt
    return state.tokenizer.decode(out.prompt_token_ids)


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    request_id: str,
    params: SamplingParams,
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[str]:
    n = params.n
    offsets = [0] * (len(streams) * n)
    echoed: set[int] = set()
    usage = UsageInfo()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    async for p_index, out in merged(streams):
        if p_index not in echoed:
            echoed.add(p_index)
            usage.prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            index = p_index * n + c.index
            text = c.text
            if req.echo and offsets[index] == 0:
                text = _echo(state, req, out) + text
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                extend_completion_logprobs(
                    logprobs, c.token_ids, c.logprobs or [], req.logprobs, offsets[index]
                )
            offsets[index] += len(text)
            usage.completion_tokens += len(c.token_ids)
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            yield sse(CompletionResponse(id=request_id, model=state.model_name, choices=[choice]))
    if include_usage:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        yield sse(
            CompletionResponse(id=request_id, model=state.model_name, choices=[], usage=usage)
        )
