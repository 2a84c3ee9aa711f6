"""POST /v1/chat/completions: render the conversation with the chat template (off the event
loop: a template may run for seconds), then generate, streamed as chunks or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tinyvllm.engine.engine import check_text
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.chat_media import chat_messages
from tinyvllm.server.errors import bad_request
from tinyvllm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from tinyvllm.server.sampling import chat_logprobs, chat_sampling, prompt_logprobs_json
from tinyvllm.server.serving import (
    ServerState,
    collect,
    event_stream,
    new_id,
    run_request,
    sse,
    unless_disconnected,
)
from tinyvllm.utils.chat_template import render_chat_template


def render_prompt(
    state: ServerState,
    messages: list[ChatMessage],
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    add_special_tokens: bool,
    template_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The engine prompt (text and token ids) of a conversation; ValueError on a bad one."""
    tokenizer = state.tokenizer
    template = chat_template or state.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; start the server with "
            "--chat-template FILE or use /v1/completions"
        )
    flat, media = chat_messages(
        [m.model_dump(exclude_none=True) for m in messages],
        state.accepts_media,
        state.model_name,
        state.limits,
        state.placeholders,
    )
    text = render_chat_template(
        tokenizer,
        flat,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **template_kwargs,
    )
    ids = tokenizer.encode(check_text(text, "the chat"), add_special_tokens=add_special_tokens)
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
    if media:  # the engine expands each placeholder to its item's tokens
        prompt["multi_modal_data"] = media
    return prompt


async def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> dict[str, Any]:
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools is not None:
        kwargs["tools"] = req.tools
    try:
        return await asyncio.to_thread(
            render_prompt,
            state,
            req.messages,
            req.chat_template,
            req.add_generation_prompt,
            req.continue_final_message,
            req.add_special_tokens,
            kwargs,
        )
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw: Request
) -> ChatCompletionResponse | StreamingResponse:
    state.check_generative(req.model)
    params = chat_sampling(req, state.sampling_defaults)
    prompt = await chat_prompt(state, req)
    request_id = req.request_id or new_id("chatcmpl")
    stream = run_request(state, prompt, params, request_id)
    top = req.top_logprobs or 0
    if req.stream:
        return await event_stream(_chunks(state, req, request_id, params, stream), raw)
    last, parts = await unless_disconnected(raw, collect(stream, params.n))
    choices = []
    for i, part in enumerate(parts):
        logprobs = None
        if req.logprobs:
            logprobs = ChatLogprobs(content=chat_logprobs(part.token_ids, part.logprobs, top))
        choices.append(
            ChatChoice(
                index=i,
                message=AssistantMessage(content=part.text),
                logprobs=logprobs,
                finish_reason=part.finish_reason,
                stop_reason=part.stop_reason,
            )
        )
    prompt_tokens = len(last.prompt_token_ids)
    completion_tokens = sum(len(p.token_ids) for p in parts)
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    return ChatCompletionResponse(
        id=request_id,
        model=state.model_name,
        choices=choices,
        usage=usage,
        prompt_logprobs=prompt_logprobs_json(last.prompt_logprobs),
    )


async def _chunks(
    state: ServerState,
    req: ChatCompletionRequest,
    request_id: str,
    params: SamplingParams,
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    """OpenAI's chunk sequence: a role chunk per choice, content deltas, a chunk with the
    finish reason, then (stream_options.include_usage) one usage chunk with no choices."""
    model = state.model_name
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    top = req.top_logprobs or 0
    started = [False] * params.n
    usage = UsageInfo()

    def chunk(choices: list[ChatChunkChoice], with_usage: bool = False) -> str:
        body = ChatCompletionChunk(id=request_id, model=model, choices=choices)
        if with_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            body.usage = usage
        return sse(body)

    async for out in stream:
        usage.prompt_tokens = len(out.prompt_token_ids)
        for c in out.outputs:
            usage.completion_tokens += len(c.token_ids)
            if not started[c.index]:
                started[c.index] = True
                role = ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant"))
                yield chunk([role], continuous)
            logprobs = None
            if req.logprobs and c.token_ids:
                logprobs = ChatLogprobs(content=chat_logprobs(c.token_ids, c.logprobs or [], top))
            if not c.text and not c.finish_reason and logprobs is None:
                continue
            choice = ChatChunkChoice(
                index=c.index,
                delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            yield chunk([choice], continuous)
    if include_usage:
        yield chunk([], with_usage=True)
