"""EngineLoop: the one thread that drives an Engine, and the command queue into it.

The Engine is not thread-safe, so only this thread touches it. Other threads post commands
(add, abort, call, shutdown) that the thread applies, in order, between steps; with nothing to
run it blocks on the queue, so an idle engine burns no CPU. Outputs go back through each
request's Sink: one `call_soon_threadsafe` per event loop per step for asyncio consumers, a
plain queue put for threads.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import functools
import logging
import queue
import signal
import threading
import time
import weakref
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING

from tinyvllm.engine.engine import Engine
from tinyvllm.engine.pooling_engine import PoolingEngine
from tinyvllm.engine.streams import (
    Abort,
    Add,
    Call,
    Command,
    CommandFuture,
    EngineDeadError,
    Feed,
    RequestError,
    Shutdown,
    Sink,
    StreamItem,
    put_all,
)
from tinyvllm.outputs import RequestOutput

if TYPE_CHECKING:  # torch stays unloaded until an engine is built
    from tinyvllm.platforms.interface import Platform

logger = logging.getLogger(__name__)

# How long the exit hook waits for the engine thread to finish its step and stop.
EXIT_JOIN_TIMEOUT_S = 30.0
# Woken from idle, the loop takes commands arriving within this gap of each other (up to
# SETTLE_MAX_S in all) before its first step: a burst of requests (asyncio.gather over
# AsyncLLM.generate, a server's) arrives over a few hundred microseconds.
SETTLE_GAP_S = 0.0005
SETTLE_MAX_S = 0.002


class EngineLoop:
    """Owns the engine thread. `post` and `walk_away` are safe from any thread."""

    def __init__(self, engine: Engine | PoolingEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Guards the flags below against the thread stopping while a caller posts.
        self._lock = threading.Lock()
        self.accepting = True
        self.stopped = False
        self.dead_error: EngineDeadError | None = None
        # Engine-thread state: only the engine thread reads or writes these.
        self._sinks: dict[str, Sink] = {}
        self._pending: collections.deque[Command] = collections.deque()
        self._needs_flush = False
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)
        # A daemon thread still inside torch when the interpreter finalizes is killed by an
        # unwind that C++ turns into abort() (exit 134, the user's traceback and exit status
        # lost), so the thread is stopped at exit. The hook holds only a weak reference.
        self._exit_hook = functools.partial(_stop_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
        platform = _platform(engine)
        if platform is not None:
            platform.hand_over_steps()
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------
    def post(self, command: Command) -> None:
        """Queue a command. Adds raise EngineDeadError / RuntimeError once the loop is dead or
        shut down; other commands are answered at once then (aborts: done, calls: the error)."""
        with self._lock:
            if isinstance(command, Add):
                if self.dead_error is not None:
                    raise self.new_dead_error()
                if not self.accepting:
                    raise RuntimeError("AsyncLLM has been shut down; create a new one")
            elif isinstance(command, Shutdown):
                self.accepting = False
            if not self.stopped:
                self._commands.put(command)
                return
        if not isinstance(command, Shutdown):
            self._answer(command, RuntimeError("AsyncLLM has been shut down"))

    def walk_away(self, sink: Sink) -> None:
        """The consumer of `sink` is gone: abort its request (if the id is still its own).

        Runs from finalizers too, so it neither raises nor takes the lock (a finalizer may fire
        in a thread that already holds it); SimpleQueue.put is safe there.
        """
        if not self.stopped:
            self._commands.put(Abort([sink.request_id], CommandFuture(), sink))

    def join(self, timeout: float | None) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError("shutdown() cannot be called from the engine thread")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine thread did not stop within {timeout} s")
        atexit.unregister(self._exit_hook)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def new_dead_error(self) -> EngineDeadError:
        # A fresh instance per raise: one exception object raised in many tasks would collect
        # all of their tracebacks.
        dead = self.dead_error
        assert dead is not None
        err = EngineDeadError(str(dead))
        err.__cause__ = dead.__cause__
        return err

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        # Ctrl-C belongs to the main thread: a SIGINT taken here (or by the worker threads this
        # thread starts, which inherit the mask) would not wake a main thread blocked in
        # select(), e.g. a REPL's readline prompt, until the next key press.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        import torch  # loaded by now: the engine this loop drives is built

        platform = _platform(self.engine)
        in_a_row = platform.steps_in_a_row() if platform is not None else nullcontext()
        try:
            # Held for the thread's life (both are per thread; only engine work runs here), as
            # LLM.generate holds them across its steps: each step otherwise set torch's
            # thread count and back, and ops between steps woke and slept its second thread.
            with torch.inference_mode(), in_a_row:
                self._loop()
        except BaseException as exc:  # never leave a stream waiting on a dead thread
            logger.exception("the engine loop died")
            self._die(exc)
            return
        with self._lock:
            self.stopped = True
            self.accepting = False
        self._resolve_pending(RuntimeError("AsyncLLM has been shut down"))

    def _loop(self) -> None:
        closing = False
        # The last step scheduled nothing and changed nothing, so stepping again would spin:
        # only a command (an add or an abort) can change what is schedulable.
        stalled = False
        while True:
            unfinished = self.engine.has_unfinished_requests()
            busy = self._needs_flush or (unfinished and not stalled)
            if closing and not busy:
                if unfinished:  # stalled: draining would never end
                    self._abort_all()
                return
            commands = self._take_commands(block=not busy)
            if commands and not busy:
                commands += self._settle()
            stalled = stalled and not commands
            self._pending.extend(commands)
            while self._pending:
                command = self._pending[0]  # left queued until applied: a crash answers it
                if isinstance(command, Add):
                    self._apply_add(command)
                elif isinstance(command, Feed):
                    self._apply_feed(command)
                elif isinstance(command, Abort):
                    self._apply_abort(command)
                elif isinstance(command, Call):
                    self._apply_call(command)
                else:
                    closing = True
                    if not command.drain:
                        self._abort_all()
                self._pending.popleft()
            if self.engine.has_unfinished_requests() or self._needs_flush:
                self._needs_flush = False
                outputs = self.engine.step()
                # The runner drops finished rows at the next step; when that would be the idle
                # wait, an empty step tells it now instead.
                self._needs_flush = any(out.finished for out in outputs)
                stalled = self.engine.last_step_empty and not outputs
                # Streaming requests waiting for input are no deadlock: a Feed wakes the loop.
                waits = getattr(self.engine, "awaiting_input", False)
                if stalled and self.engine.has_unfinished_requests() and not waits:
                    logger.warning(
                        "no request can be scheduled; waiting for new requests or aborts"
                    )
                self._dispatch(outputs)

    def _take_commands(self, block: bool) -> list[Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _settle(self) -> list[Command]:
        """The commands that keep arriving within SETTLE_GAP_S of each other."""
        commands: list[Command] = []
        deadline = time.monotonic() + SETTLE_MAX_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                commands.append(self._commands.get(timeout=min(SETTLE_GAP_S, left)))
            except queue.Empty:
                break
        return commands

    def _apply_add(self, command: Add) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the caller was cancelled before the add ran
        rid = command.sink.request_id
        try:
            if command.streaming:
                self.engine.add_request(rid, command.prompt, command.params, streaming=True)
            else:
                self.engine.add_request(rid, command.prompt, command.params)
        except Exception as exc:
            command.future.set_exception(exc)
            return
        self._sinks[rid] = command.sink
        command.future.set_result(rid)

    def _apply_feed(self, command: Feed) -> None:
        """Append a chunk to (or end the input of) a streaming request; a chunk the engine
        refuses fails that request alone, with the engine's message."""
        rid = command.sink.request_id
        if self._sinks.get(rid) is not command.sink:
            return  # finished or aborted meanwhile: the rest of its input has nowhere to go
        if command.abort:
            out = self._abort_output(rid)
            self._drop(rid)  # before delivery: the consumer may look at the engine at once
            self._deliver([(command.sink, out)])
            return
        engine = self.engine
        assert isinstance(engine, Engine)
        try:
            if command.error is not None:
                raise ValueError(command.error)
            if command.prompt is not None:
                engine.append_input(rid, command.prompt)
            if command.end:
                self._dispatch(engine.end_input(rid))
        except (ValueError, TypeError) as exc:
            self._needs_flush = True
            self._dispatch(engine.fail_request(rid, str(exc)))

    def _apply_call(self, command: Call) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            command.future.set_result(command.fn(self.engine))
        except Exception as exc:
            command.future.set_exception(exc)

    def _apply_abort(self, command: Abort) -> None:
        deliveries: list[tuple[Sink, StreamItem]] = []
        for rid in command.request_ids:
            sink = self._sinks.get(rid)
            if command.sink is not None:
                if sink is command.sink:
                    self._drop(rid)
                continue
            if sink is not None:
                deliveries.append((sink, self._abort_output(rid)))
            self._drop(rid)
        self._deliver(deliveries)
        # Runs even when the waiter was cancelled: giving up on waiting does not undo an abort.
        if command.future.set_running_or_notify_cancel():
            command.future.set_result(None)

    def _abort_all(self) -> None:
        deliveries = [(sink, self._abort_output(rid)) for rid, sink in self._sinks.items()]
        for rid in self.engine.unfinished_request_ids():
            self._drop(rid)
        self._sinks.clear()
        self._deliver(deliveries)

    def _drop(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self.engine.abort_request(rid)
        self._needs_flush = True

    def _abort_output(self, rid: str) -> RequestOutput:
        """The final output of an aborted request: what it generated, finish_reason "abort"."""
        try:
            out = self.engine.aborted_output(rid)
        except Exception:  # e.g. a detokenizer that fails: the stream must still end
            logger.exception("building the abort output of %s failed", rid)
            out = None
        if out is not None:
            return out
        return RequestOutput(
            request_id=rid,
            prompt=None,
            prompt_token_ids=[],
            prompt_logprobs=None,
            outputs=[],
            finished=True,
        )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        deliveries: list[tuple[Sink, StreamItem]] = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.error is not None:
                if not out.finished:  # one of n samples failed, so the request has failed
                    self._drop(out.request_id)
                self._sinks.pop(out.request_id, None)
                deliveries.append((sink, RequestError(out.request_id, out.error, out)))
                continue
            if out.finished:
                del self._sinks[out.request_id]
            if out.metrics is not None:
                # The engine keeps updating its metrics object; hand out a snapshot.
                out.metrics = replace(out.metrics)
            deliveries.append((sink, out))
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[Sink, StreamItem]]) -> None:
        # One wakeup per event loop per step, however many of its streams got output.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, StreamItem]]] = {}
        for sink, item in deliveries:
            if sink.loop is None:
                sink.put(item)
            else:
                by_loop.setdefault(sink.loop, []).append((sink, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                for sink, _ in items:
                    if self._sinks.get(sink.request_id) is sink:
                        self._drop(sink.request_id)

    def _die(self, exc: BaseException) -> None:
        dead = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
        dead.__cause__ = exc
        with self._lock:
            self.dead_error = dead
            self.accepting = False
            self.stopped = True
        sinks, self._sinks = list(self._sinks.values()), {}
        try:
            self._deliver([(sink, self.new_dead_error()) for sink in sinks])
        except Exception:
            logger.exception("reporting the engine failure to the streams failed")
        self._resolve_pending(dead)

    def _resolve_pending(self, error: BaseException) -> None:
        """Answer commands posted before the thread stopped; none can arrive after."""
        self._pending.extend(self._take_commands(block=False))
        while self._pending:
            command = self._pending.popleft()
            if not isinstance(command, Shutdown):
                self._answer(command, error)

    def _answer(self, command: Add | Feed | Abort | Call, error: BaseException) -> None:
        """Resolve a command that will never run: an abort is moot, the rest fail (a Feed's
        stream fails through its request)."""
        if isinstance(command, Feed):
            return
        future = command.future
        if future.done() or (not future.running() and not future.set_running_or_notify_cancel()):
            return  # answered already, or cancelled by its caller
        if isinstance(command, Abort):
            future.set_result(None)
        else:
            future.set_exception(self.new_dead_error() if self.dead_error is not None else error)


def _platform(engine: Engine | PoolingEngine) -> Platform | None:  # None: no runner's platform
    return getattr(getattr(engine, "runner", None), "platform", None)


def _stop_at_exit(loop_ref: weakref.ref[EngineLoop]) -> None:
    """atexit: abort what is in flight and stop the engine thread before finalization."""
    loop = loop_ref()
    if loop is None or not loop.is_alive:
        return
    try:
        loop.post(Shutdown(drain=False))
        loop.join(EXIT_JOIN_TIMEOUT_S)
    except Exception as exc:  # never mask the program's own exit status
        logger.warning("stopping the engine thread at exit failed: %s", exc)
