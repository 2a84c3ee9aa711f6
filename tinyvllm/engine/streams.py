"""What travels between AsyncLLM's callers and its engine thread: commands, per-request sinks,
the blocking stream iterator, and the errors a stream can raise."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from tinyvllm.engine.prompts import PromptType
from tinyvllm.outputs import PoolingRequestOutput, RequestOutput
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams

StreamItem = RequestOutput | PoolingRequestOutput[Any] | BaseException


class EngineDeadError(RuntimeError):
    """The engine loop crashed (an exception escaped `Engine.step`); nothing can run any more."""


class RequestError(Exception):
    """One request failed inside the engine (e.g. its detokenization raised); others go on.

    `output` is the request's last RequestOutput (finish_reason "error"), holding whatever was
    generated before the failure.
    """

    def __init__(
        self,
        request_id: str,
        message: str,
        output: RequestOutput | PoolingRequestOutput[Any] | None = None,
    ) -> None:
        super().__init__(f"request {request_id!r} failed: {message}")
        self.request_id = request_id
        self.message = message
        self.output = output


class CommandFuture(concurrent.futures.Future):
    """Resolves once the engine thread has applied a command. `.result()` waits from a thread;
    it can also be awaited from asyncio. Commands are applied in the order they were posted."""

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.wrap_future(self).__await__()


@dataclass(eq=False)
class Sink:
    """Where one request's outputs go; `loop` is the consumer's event loop (None: a thread)."""

    request_id: str
    put: Callable[[StreamItem], None]
    loop: asyncio.AbstractEventLoop | None = None


@dataclass
class Add:
    prompt: PromptType
    params: SamplingParams | PoolingParams
    sink: Sink
    future: CommandFuture
    # `prompt` is the first chunk of a streaming-input request (Feed brings the rest).
    streaming: bool = False


@dataclass
class Feed:
    """The next input of the streaming request added through `sink`: a chunk, the end of the
    input, why the input failed (the request then fails with that message), or that it was
    cancelled (the request is aborted)."""

    sink: Sink
    prompt: PromptType | None = None
    end: bool = False
    error: str | None = None
    abort: bool = False


@dataclass
class Abort:
    request_ids: list[str]
    future: CommandFuture
    # Set when a consumer walked away: abort only if the id still belongs to this sink (the
    # add may have failed as a duplicate of someone else's request).
    sink: Sink | None = None


@dataclass
class Call:
    """Run `fn(engine)` on the engine thread (e.g. reset_prefix_cache)."""

    fn: Callable[[Any], Any]
    future: CommandFuture


@dataclass
class Shutdown:
    drain: bool


Command = Add | Feed | Abort | Call | Shutdown


class RequestStream:
    """Blocking iterator over one request's outputs (what `AsyncLLM.stream` returns).

    Closing it, leaving its `with` block or dropping it aborts the request if unfinished.
    """

    def __init__(
        self,
        request_id: str,
        outputs: queue.SimpleQueue[StreamItem],
        on_close: Callable[[], None],
        timeout: float | None = None,
    ) -> None:
        self.request_id = request_id
        self._on_close = on_close
        self._outputs = outputs
        self._timeout = timeout
        self._done = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        try:
            item = self._outputs.get(timeout=self._timeout)
        except queue.Empty:
            self.close()
            raise TimeoutError(
                f"no output for request {self.request_id!r} within {self._timeout} s"
            ) from None
        except BaseException:  # e.g. KeyboardInterrupt: nobody will read the rest
            self.close()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._on_close()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def new_request_id(request_id: str | None) -> str:
    if request_id is None:
        return uuid.uuid4().hex
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    return request_id


def put_all(items: list[tuple[Sink, StreamItem]]) -> None:
    for sink, item in items:
        sink.put(item)
