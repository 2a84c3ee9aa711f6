"""AsyncLLM: stream requests from asyncio or from plain threads while one background thread
(the EngineLoop) drives the Engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

from tinyvllm.config import EngineArgs
from tinyvllm.engine.engine import Engine, PromptType
from tinyvllm.engine.engine_loop import EngineLoop
from tinyvllm.engine.factory import AnyEngine, create_engine
from tinyvllm.engine.pooling_engine import PoolingEngine
from tinyvllm.engine.streams import (
    Abort,
    Add,
    Call,
    CommandFuture,
    EngineDeadError,
    Feed,
    RequestError,
    RequestStream,
    Shutdown,
    Sink,
    StreamItem,
    new_request_id,
)
from tinyvllm.inputs import StreamingInput
from tinyvllm.outputs import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.stats import EngineStats

__all__ = [
    "AsyncLLM",
    "CommandFuture",
    "EngineDeadError",
    "RequestError",
    "RequestStream",
    "StreamingInput",
]


class AsyncLLM:
    """Streaming front end over one Engine, usable from asyncio and from plain threads.

    >>> llm = AsyncLLM("HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=2048)
    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="a"):
    ...     print(out.outputs[0].text)
    >>> for out in llm.stream("Hello", SamplingParams(max_tokens=32)):  # from any thread
    ...     print(out.outputs[0].text)
    >>> llm.shutdown()

    A finished stream ends after its output with `finished=True`. A request that fails inside
    the engine raises `RequestError`; if the engine loop itself crashes, every stream and every
    later call raises `EngineDeadError`. Abandoning a stream (cancelling its task, leaving the
    `async for`, closing the iterator) aborts the request and frees its KV blocks before the
    engine's next step; `abort(request_id)` ends the stream with finish_reason "abort".
    """

    def __init__(self, model: str | AnyEngine, **engine_kwargs: Any) -> None:
        if isinstance(model, Engine | PoolingEngine):
            if engine_kwargs:
                raise TypeError(
                    f"engine arguments {sorted(engine_kwargs)} cannot apply to an already-built "
                    "Engine; pass a model name instead"
                )
            self.engine_args: EngineArgs | None = None
            self.engine = model
        else:
            # The same construction path as LLM, so both accept exactly the same arguments.
            self.engine_args = EngineArgs.from_kwargs(model, **engine_kwargs)
            self.engine = create_engine(self.engine_args)
        self._engine_loop = EngineLoop(self.engine)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        llm = cls(create_engine(args))
        llm.engine_args = args
        return llm

    # ---- public API -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType | AsyncIterable[StreamingInput],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (DELTA / CUMULATIVE / FINAL_ONLY per `output_kind`).

        A bad prompt or duplicate request_id raises ValueError at the first iteration.

        `prompt` may be an async iterator of StreamingInput chunks (streaming input): the
        request starts with the first chunk and takes each later one as it comes; it generates
        once the iterator ends (a realtime audio model: as each position's audio arrives). A
        chunk the engine refuses, or an iterator that raises, ends the request with
        RequestError; abandoning the output stream aborts it and closes the iterator.
        """
        outputs: asyncio.Queue[StreamItem] = asyncio.Queue()
        sink = Sink(new_request_id(request_id), outputs.put_nowait, asyncio.get_running_loop())
        chunks = aiter(prompt) if isinstance(prompt, AsyncIterable) else None
        feeder: asyncio.Task[None] | None = None
        done = False
        try:
            if chunks is not None:
                first = await _first_chunk(chunks)
                params = first.sampling_params or sampling_params
                await self._submit(first.prompt, params, sink, streaming=True)
            else:
                await self._submit(prompt, sampling_params, sink)
            if chunks is not None:
                feeder = asyncio.create_task(self._feed(chunks, sink))
            while not done:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if feeder is not None:
                feeder.cancel()
            elif chunks is not None:  # not added: the iterator is not read any more
                await _close(chunks)
            if not done:
                self._engine_loop.walk_away(sink)

    async def _feed(self, chunks: AsyncIterator[StreamingInput], sink: Sink) -> None:
        """Post a streaming request's chunks to the engine as they come, then its end."""
        post = self._engine_loop.post
        try:
            async for chunk in chunks:
                if not isinstance(chunk, StreamingInput):
                    post(Feed(sink, error=_not_a_chunk(chunk)))
                    return
                if chunk.sampling_params is not None:
                    post(
                        Feed(
                            sink,
                            error="sampling_params can be set on the first StreamingInput "
                            "only; leave it None on later chunks",
                        )
                    )
                    return
                post(Feed(sink, prompt=chunk.prompt))
        except Exception as exc:  # the caller's iterator failed: so does its request
            post(Feed(sink, error=f"the input stream raised {type(exc).__name__}: {exc}"))
            return
        except asyncio.CancelledError:
            # Cancelled inside the caller's iterator (its producer was cancelled), not by
            # generate() (which cancels this task once the request is done): abort it.
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if cancelling is not None and not cancelling():
                post(Feed(sink, abort=True))
            raise
        finally:
            await _close(chunks)
        post(Feed(sink, end=True))

    async def embed(
        self,
        prompt: PromptType,
        *,
        request_id: str | None = None,
        truncate_prompt_tokens: int | None = None,
        normalize: bool | None = None,
    ) -> EmbeddingRequestOutput:
        """One prompt's embedding (`.outputs.embedding`), pooled as the model's pooler says.

        Concurrent calls batch together in the engine. Needs a pooling model (runner="pooling"
        or detected). A bad prompt raises ValueError (too long: pass truncate_prompt_tokens); a
        failed step raises RequestError. Cancelling the call aborts the request.
        """
        self._require_pooling("embed")
        params = PoolingParams(truncate_prompt_tokens, normalize, task="embed")
        return EmbeddingRequestOutput.from_base(await self._pool(prompt, params, request_id))

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
    ) -> PoolingRequestOutput[PoolingOutput]:
        """One pooling request: `.outputs.data` is its embedding or, with
        `PoolingParams(task="token_embed")`, every token's hidden state."""
        self._require_pooling("encode")
        params = pooling_params.clone() if pooling_params is not None else PoolingParams()
        return await self._pool(prompt, params, request_id)

    async def _pool(
        self, prompt: PromptType, params: PoolingParams, request_id: str | None
    ) -> PoolingRequestOutput[PoolingOutput]:
        outputs: asyncio.Queue[StreamItem] = asyncio.Queue()
        sink = Sink(new_request_id(request_id), outputs.put_nowait, asyncio.get_running_loop())
        future = CommandFuture()
        self._engine_loop.post(Add(prompt, params, sink, future))
        done = False
        try:
            await future
            item = await outputs.get()
            done = True
        finally:
            if not done:
                self._engine_loop.walk_away(sink)
        if isinstance(item, BaseException):
            raise item
        if item.outputs is None:  # aborted (by id, or the engine shut down)
            raise RequestError(item.request_id, "the request was aborted", item)
        return item

    def _require_pooling(self, what: str) -> None:
        if self.engine.runner_type != "pooling":
            model = self.engine.config.model.model
            raise ValueError(
                f"{what}() needs a pooling model, but {model!r} runs as a generative "
                f"model here; create the engine with runner='pooling' (e.g. "
                f"AsyncLLM({model!r}, runner='pooling')) to pool its hidden states"
            )

    def stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """The blocking twin of `generate` for threads: returns an iterator of RequestOutputs.

        Submits at once, so a bad prompt raises ValueError here: it waits for the engine to
        accept the request, up to one step, so many requests submitted one after another from
        one thread join the batch one step apart (use `generate` from an event loop to submit
        a batch at once). `timeout` bounds the wait for each output (TimeoutError, and the
        request is aborted). Do not call it on an event loop.
        """
        outputs: queue.SimpleQueue[StreamItem] = queue.SimpleQueue()
        sink = Sink(new_request_id(request_id), outputs.put)
        added = self._submit(prompt, sampling_params, sink)
        try:
            added.result()
        except BaseException:
            self._engine_loop.walk_away(sink)
            raise
        return RequestStream(
            sink.request_id, outputs, functools.partial(self._engine_loop.walk_away, sink), timeout
        )

    def abort(self, request_id: str | Iterable[str]) -> CommandFuture:
        """Abort requests by id from any thread; their streams end with finish_reason "abort".

        Returns a future that resolves once the engine thread has aborted them (blocks freed).
        Unknown or finished ids are ignored.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        future = CommandFuture()
        self._engine_loop.post(Abort(ids, future))
        return future

    def shutdown(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests, finish (`drain=True`) or abort the in-flight ones, join the
        engine thread. Idempotent; raises TimeoutError if the thread outlives `timeout`."""
        self._engine_loop.post(Shutdown(drain))
        self._engine_loop.join(timeout)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_stats(self, include_blocks: bool = False) -> EngineStats:
        """The engine's statistics snapshot (`Engine.get_stats()` is safe from any thread);
        `include_blocks` adds every KV block's state for a block map."""
        return self.engine.get_stats(include_blocks=include_blocks)

    def reset_prefix_cache(self) -> CommandFuture:
        """Forget all cached prefixes, on the engine thread between steps; the future (also
        awaitable) gives the engine's answer."""
        return self._call(lambda engine: engine.reset_prefix_cache())

    @property
    def is_running(self) -> bool:
        """True while requests are accepted: not shut down and the engine loop is alive."""
        core = self._engine_loop
        return core.accepting and core.dead_error is None and core.is_alive

    @property
    def errored(self) -> bool:
        return self._engine_loop.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._engine_loop.dead_error

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Joining blocks; keep the loop free so aborted streams can still be delivered.
        await asyncio.to_thread(self.shutdown)

    # ---- caller side ------------------------------------------------------------------------
    def _submit(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        sink: Sink,
        streaming: bool = False,
    ) -> CommandFuture:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        future = CommandFuture()
        # A private copy: the engine thread must never see the caller mutate it.
        if streaming and self.engine.runner_type != "generate":
            raise ValueError("streaming input needs a generative model, not a pooling one")
        self._engine_loop.post(Add(prompt, params.clone(), sink, future, streaming))
        return future

    def _call(self, fn: Callable[[Engine], Any]) -> CommandFuture:
        """Run `fn(engine)` on the engine thread; its result or exception lands in the future."""
        future = CommandFuture()
        self._engine_loop.post(Call(fn, future))
        return future


async def _first_chunk(chunks: AsyncIterator[StreamingInput]) -> StreamingInput:
    """The chunk a streaming request starts with (ValueError for an empty or bad stream)."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        raise ValueError(
            "the input stream ended before its first StreamingInput; a streaming request needs "
            "at least one chunk"
        ) from None
    if not isinstance(first, StreamingInput):
        raise ValueError(_not_a_chunk(first))
    return first


def _not_a_chunk(item: object) -> str:
    return (
        f"the input stream must yield StreamingInput chunks, got {type(item).__name__}; wrap "
        "each chunk as StreamingInput(prompt=...)"
    )


async def _close(chunks: AsyncIterator[StreamingInput]) -> None:
    """Close the caller's iterator (an async generator runs its cleanup)."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        # RuntimeError: still running (cancelled mid-__anext__); it unwinds on its own.
        with contextlib.suppress(RuntimeError):
            await aclose()
