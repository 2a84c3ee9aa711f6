"""The first engine's imports (torch and the model stack), with the cyclic garbage collector
kept out of them.

Importing torch builds ~250k Python objects. With the collector on, that triggers ~400
collections, the full ones among them scanning everything built so far, and every full
collection while the engine loads scans all of torch again: 0.5-0.9 s of a ~2 s start-up here.
Modules live until the process ends, so their objects are frozen (`gc.freeze`): never scanned
again, yet freed by reference counting as usual. Only this import is frozen, never an engine:
an engine's cycles (dropped by `/load` in the chat REPL, or by a test) must stay collectable.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import sys
import threading

# What every engine imports while it loads: torch, and the tinyvllm modules that import most
# of it (the loader and the runner); the rest of an engine's imports are small.
RUNTIME_MODULES = ("torch", "tinyvllm.models.loader", "tinyvllm.runner.model_runner")


def import_runtime() -> None:
    """Import `RUNTIME_MODULES` with the collector paused, then freeze every object alive (the
    modules' and whatever the program built before). Once they are imported: nothing."""
    if all(name in sys.modules for name in RUNTIME_MODULES):
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        # In a thread of its own: the garbage the imports leave (exceptions caught while torch
        # imports, their tracebacks) is frozen with everything else, and a frame in it holds
        # its callers' frames; in this thread those would be the engine's constructors, whose
        # locals (the engine) would then never be collected. A thread's frames end at the thread.
        failures: list[BaseException] = []
        thread = threading.Thread(target=_import_modules, args=(failures,), name="tinyvllm-import")
        thread.start()
        thread.join()
        if failures:
            raise failures[0]
        gc.freeze()
        # Back to the collector at exit: interpreter shutdown's collections then free the frozen
        # cycles too, as they did before; left frozen, extension types still alive at the end
        # are reported as leaks (triton's nanobind bindings print hundreds of lines).
        atexit.register(gc.unfreeze)
    finally:
        if was_enabled:
            gc.enable()


def _import_modules(failures: list[BaseException]) -> None:
    try:
        for name in RUNTIME_MODULES:
            importlib.import_module(name)
    except BaseException as exc:  # re-raised by the caller, in its own thread
        failures.append(exc)
