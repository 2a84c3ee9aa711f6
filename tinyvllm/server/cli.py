"""`tinyvllm serve [MODEL]`: flags named as `vllm serve` names them, and startup.

`tinyvllm.cli` declares the engine flags the other commands share and resolves the model;
this module adds the server's own flags and runs it. Declaring the flags imports nothing heavy
(no fastapi), so `tinyvllm --help` works without the `serve` extra; running the command checks
for it first and says how to install it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinyvllm.server.limits import ServerLimits
    from tinyvllm.server.serving import ServerState

API_KEY_ENV = "TINYVLLM_API_KEY"
INSTALL_HINT = "pip install 'tinyvllm[serve]' (or: pip install fastapi uvicorn)"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's flags besides the shared engine ones (`--model`, `--dtype`, ...)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every endpoint but /health "
        f"(default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use as `model` (default: the model as given)",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument(
        "--chat-template", default=None, help="a Jinja chat template file (or the template)"
    )
    p.add_argument(
        "--runner",
        choices=("auto", "generate", "pooling"),
        default=None,
        help="pooling: serve an embedding model on /v1/embeddings (default: auto, from the "
        "checkpoint)",
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--uvicorn-log-level", default="info")
    add_limit_arguments(p)


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """Bounds on untrusted input (see `tinyvllm.server.limits` for the defaults' reasons)."""
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="let clients name files under DIR as file:// image/video URLs (default: file:// "
        "URLs are refused; data: URLs always work)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="larger request bodies get a 413 (default 64 MiB)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help="larger images (width x height, and video frames) get a 400 (default 89478485, "
        "Pillow's decompression-bomb threshold)",
    )
    p.add_argument(
        "--max-media-pixels-per-request",
        type=int,
        default=None,
        help="requests whose images and kept video frames add up to more pixels get a 400 "
        "(default: 3x --max-image-pixels' default)",
    )
    p.add_argument(
        "--max-video-frames",
        type=int,
        default=None,
        help="videos with more frames get a 400 (default 18000)",
    )


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The limits the flags set (the defaults where not given); ValueError naming a bad flag."""
    from tinyvllm.server.limits import ServerLimits, limit_names

    given: dict[str, Any] = {
        n: getattr(args, n) for n in limit_names() if getattr(args, n) is not None
    }
    if args.allowed_local_media_path is not None:
        given["allowed_local_media_path"] = Path(args.allowed_local_media_path)
    return ServerLimits(**given)


def serve_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine arguments from the server-only flags the user gave."""
    kwargs: dict[str, Any] = {}
    for name in (
        "runner",
        "tokenizer",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "enable_prefix_caching",
    ):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.speculative_config is not None:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {spec!r}")
        kwargs["speculative_config"] = spec
    return kwargs


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as a template: a file's text, or the value itself if it looks like one."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template {value!r}: no such file (nor a Jinja template)")


def check_installed() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"`tinyvllm serve` needs fastapi and uvicorn ({exc}); {INSTALL_HINT}"
        ) from None


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $TINYVLLM_API_KEY; None (no key needed) when neither is set."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def model_spec(args: argparse.Namespace) -> str | None:
    """MODEL or --model (None: the catalog default)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag or args.model


def load_server_state(
    args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any], label: str
) -> ServerState:
    """Start the engine (runner auto-detected unless --runner says) and the routes' state;
    the caller shuts `state.engine` down."""
    from tinyvllm.chat.defaults import model_sampling_defaults
    from tinyvllm.engine.async_llm import AsyncLLM
    from tinyvllm.server.serving import ServerState

    chat_template = read_chat_template(args.chat_template)
    limits = server_limits(args)
    engine = AsyncLLM(model, **engine_kwargs)
    try:
        model_path = engine.engine.config.model.model_path
        return ServerState(
            engine=engine,
            model_names=args.served_model_name or [model_spec(args) or label],
            model_path=model_path,
            api_key=api_key(args),
            chat_template=chat_template,
            sampling_defaults=model_sampling_defaults(model_path),
            limits=limits,
        )
    except BaseException:
        engine.shutdown()
        raise


def run_server(
    args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any], label: str
) -> int:
    """Load the engine, serve until Ctrl-C (uvicorn's), shut the engine down."""
    import uvicorn

    from tinyvllm.server.app import build_app

    print(f"loading {label} ...", file=sys.stderr, flush=True)
    state = load_server_state(args, model, engine_kwargs, label)
    try:
        kind = "embedding model " if state.is_pooling else ""
        print(
            f"serving {kind}{state.model_name} at http://{args.host}:{args.port}/v1",
            file=sys.stderr,
            flush=True,
        )
        if getattr(getattr(state.engine.engine, "mm_processor", None), "realtime", False):
            where = f"ws://{args.host}:{args.port}/v1/realtime"
            print(f"realtime transcription at {where}", file=sys.stderr, flush=True)
        uvicorn.run(
            build_app(state), host=args.host, port=args.port, log_level=args.uvicorn_log_level
        )
    finally:
        state.engine.shutdown()
    return 0
