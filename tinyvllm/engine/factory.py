"""The engine for EngineArgs: Engine for generation, PoolingEngine for pooling models."""

from __future__ import annotations

from tinyvllm.config import EngineArgs
from tinyvllm.engine.engine import Engine
from tinyvllm.engine.pooling_engine import PoolingEngine
from tinyvllm.engine.runtime_imports import import_runtime
from tinyvllm.engine.setup import build_engine_config, load_tokenizer

AnyEngine = Engine | PoolingEngine


def create_engine(args: EngineArgs) -> AnyEngine:
    """Validate `args`, resolve them against the checkpoint, and build the engine that the
    resolved runner type (`runner=`, or detected) needs."""
    args.validate()
    import_runtime()
    config = build_engine_config(args)
    tokenizer = None
    if not args.skip_tokenizer_init:
        tokenizer = load_tokenizer(config.model.tokenizer, args.trust_remote_code)
    if config.model.runner_type == "pooling":
        return PoolingEngine(config, tokenizer)
    return Engine(config, tokenizer)
