"""What every generating route shares: the server's state, running one request through the
`AsyncLLM` (metrics, error mapping, abort on disconnect), and server-sent events.

Aborts need no bookkeeping here: leaving `AsyncLLM.generate`'s iterator early (an exception,
a cancelled task, a closed generator) aborts the request and frees its blocks before the
engine's next step, so every path below only has to make sure that iterator gets closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tinyvllm.engine.streams import EngineDeadError, RequestError
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.errors import APIError, error_body
from tinyvllm.server.limits import MAX_BATCH, ServerLimits
from tinyvllm.server.metrics import ServerMetrics
from tinyvllm.utils.content_parts import PLACEHOLDERS

T = TypeVar("T")


@dataclass
class ServerState:
    """Everything the routes need; one per app (no module-level state)."""

    engine: Any  # an AsyncLLM (duck-typed so tests may wrap one)
    model_names: list[str]
    model_path: str
    api_key: str | None = None
    chat_template: str | None = None
    # Sampling values the checkpoint's generation_config.json sets (used when a request omits
    # them).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    limits: ServerLimits = field(default_factory=ServerLimits)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.model.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    @property
    def is_pooling(self) -> bool:
        """Whether the engine runs a pooling (embedding) model rather than a generative one."""
        return getattr(self.engine.engine, "runner_type", "generate") == "pooling"

    @property
    def accepts_media(self) -> bool:
        """Whether the model takes images and videos (a vision-language model)."""
        processor = getattr(self.engine.engine, "mm_processor", None)
        return bool(getattr(processor, "enabled", False))

    @property
    def placeholders(self) -> Mapping[str, str]:
        """The model's text for one image / video in a chat message."""
        processor = getattr(self.engine.engine, "mm_processor", None)
        return getattr(processor, "placeholders", PLACEHOLDERS)

    def check_generative(self, name: str | None) -> None:
        """`check_model`, and a 400 when this server's model cannot generate."""
        self.check_model(name)
        if self.is_pooling:
            raise APIError(
                400,
                f"the model `{self.model_name}` is an embedding model (this server runs it "
                "with --runner pooling): use /v1/embeddings, or start a server for a "
                "generative model",
                "model",
            )

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (None or "" means the default one)."""
        if name and name not in self.model_names:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves "
                f"{', '.join(self.model_names)}",
                "model",
                "model_not_found",
            )


def engine_prompts(value: Any, param: str) -> list[Any]:
    """An API prompt field (text, token ids, or a batch of either) as a list of engine
    prompts (text, or {"prompt_token_ids": [...]})."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{param} must not be empty", param)
    if all(isinstance(x, int) for x in value):
        return [{"prompt_token_ids": list(value)}]
    if len(value) > MAX_BATCH:
        raise APIError(
            400,
            f"{param} holds {len(value)} prompts; at most {MAX_BATCH} per request: split the "
            "batch over several requests",
            param,
        )
    return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in value]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def run_request(
    state: ServerState, prompt: Any, params: SamplingParams, request_id: str
) -> AsyncIterator[RequestOutput]:
    """Stream one request's DELTA outputs; records the latency metrics, maps engine errors to
    API errors, and aborts the request when the caller stops iterating."""
    metrics = state.metrics
    with counted_request(metrics, "prompt") as outcome:
        start = last = outcome.start
        seen_token = False
        async with contextlib.aclosing(state.engine.generate(prompt, params, request_id)) as it:
            async for out in it:
                now = time.monotonic()
                new = sum(len(c.token_ids) for c in out.outputs)
                if new and not seen_token:
                    metrics.ttft.observe(now - start)
                    seen_token, new = True, new - 1
                if new:
                    metrics.itl.observe((now - last) / new, new)
                if seen_token:
                    last = now
                if out.finished:
                    outcome.reason = "error" if out.error else _reason(out)
                yield out


@dataclass
class Outcome:
    """How one engine request ended, for the metrics ("abort" until it ends otherwise)."""

    reason: str = "abort"
    start: float = field(default_factory=time.monotonic)


@contextlib.contextmanager
def counted_request(metrics: ServerMetrics, param: str) -> Iterator[Outcome]:
    """Around one engine request: maps what the engine raises to API errors (a prompt it
    refused, e.g. too long or with bad media, is the client's 400 naming `param`; a failed
    step 500; a stopped engine 503) and records the request's end in the metrics. A refused
    prompt never became a request, so it is not counted."""
    outcome = Outcome()
    try:
        yield outcome
    except ValueError as exc:
        outcome.reason = "rejected"
        raise APIError(400, str(exc), param) from None
    except RequestError as exc:
        outcome.reason = "error"
        raise APIError(500, f"the request failed in the engine: {exc}") from None
    except EngineDeadError as exc:
        outcome.reason = "error"
        raise APIError(503, f"the engine has stopped: {exc}") from None
    finally:
        if outcome.reason != "rejected":
            metrics.e2e.observe(time.monotonic() - outcome.start)
            metrics.request_finished(outcome.reason)


def _reason(out: RequestOutput) -> str:
    """One finish reason per request for the metrics: "length" only if every choice ran out."""
    reasons = sorted({c.finish_reason for c in out.outputs if c.finish_reason} - {"length"})
    return reasons[0] if reasons else "length"


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with their stream's index. Closing this
    generator (or an error in any stream) cancels the rest, which aborts their requests."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done_marker = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            # Closed however the task ends, so a cancelled pump aborts its request.
            async with contextlib.aclosing(stream) as it:  # type: ignore[type-var]
                async for item in it:
                    await queue.put((i, item, None))
            await queue.put((i, done_marker, None))
        except Exception as exc:
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done_marker:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled (so its requests are aborted at once) if the client hangs up
    first. Streaming responses need no such guard: Starlette cancels them on disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _sse_body(first: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(events) as it:  # type: ignore[type-var]
            yield first
            async for event in it:
                yield event
    except APIError as exc:  # the status is already 200: report it as an event
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    yield SSE_DONE


async def event_stream(events: AsyncIterator[str], request: Request) -> StreamingResponse:
    """A server-sent-events response of `events`, then `data: [DONE]`.

    The first event is awaited before the response starts, so a request the engine refuses
    (e.g. a prompt longer than the context) still gets its 400; an error after that is sent
    as an error event, and the stream still ends with [DONE]. A client that hangs up while
    waiting for that first event (a long queue) aborts its request then, not at the first token.
    """
    try:
        first = await unless_disconnected(request, anext(events))
    except StopAsyncIteration:
        first = ""
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    return StreamingResponse(_sse_body(first, events), media_type="text/event-stream")


@dataclass
class Choice:
    """One choice put together from DELTA outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def collect(
    stream: AsyncIterator[RequestOutput], n: int
) -> tuple[RequestOutput, list[Choice]]:
    """Run a request to its end; its last output and its `n` choices reassembled."""
    choices = [Choice() for _ in range(n)]
    last: RequestOutput | None = None
    async for out in stream:
        last = out
        for c in out.outputs:
            choice = choices[c.index]
            choice.text += c.text
            choice.token_ids += c.token_ids
            choice.logprobs += c.logprobs or []
            choice.finish_reason = c.finish_reason or choice.finish_reason
            choice.stop_reason = c.stop_reason if c.finish_reason else choice.stop_reason
    if last is None:  # the engine always sends a final output; guard the invariant anyway
        raise APIError(500, "the engine ended the request without an output")
    if last.error is not None:
        raise APIError(500, f"the request failed in the engine: {last.error}")
    return last, choices
