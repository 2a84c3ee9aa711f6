"""The engine for EngineArgs: Engine for generation, PoolingEngine for pooling models."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tinyvllm.config import EngineArgs
from tinyvllm.engine.engine import Engine
from tinyvllm.engine.pooling_engine import PoolingEngine
from tinyvllm.engine.runtime_imports import import_runtime
from tinyvllm.engine.setup import build_engine_config, load_tokenizer

AnyEngine = Engine | PoolingEngine


def create_engine(args: EngineArgs) -> AnyEngine:
    """Validate `args`, resolve them against the checkpoint, and build the engine that the
    resolved runner type (`runner=`, or detected) needs.

    The tokenizer loads in a thread while the engine loads its model (the engine waits for it
    only once the model is in place): its parsing (`tokenizers`' Rust, transformers' imports
    for a checkpoint directory) can run on another core while the weights are read and
    repacked."""
    args.validate()
    import_runtime()
    config = build_engine_config(args)
    with ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-tokenizer") as pool:
        tokenizer = None
        if not args.skip_tokenizer_init:
            tokenizer = pool.submit(load_tokenizer, config.model.tokenizer, args.trust_remote_code)
        if config.model.runner_type == "pooling":
            return PoolingEngine(config, tokenizer)
        return Engine(config, tokenizer)
