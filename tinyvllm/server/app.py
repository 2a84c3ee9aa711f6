"""The FastAPI app: routes, API-key check, and the engine's lifetime.

`build_app(state)` wires the routes to one `ServerState`; the engine (an `AsyncLLM`) runs
its own loop thread, so the app holds no second engine loop: each route just streams from it.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from fastapi import FastAPI, Request, Response, WebSocket
from fastapi.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

import tinyvllm
from tinyvllm.server.chat import chat_prompt, create_chat_completion
from tinyvllm.server.completions import create_completion
from tinyvllm.server.embeddings import create_embedding
from tinyvllm.server.errors import bad_request, error_response, install_error_handlers
from tinyvllm.server.limits import BodySizeLimit
from tinyvllm.server.metrics import render_metrics
from tinyvllm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tinyvllm.server.realtime import RealtimeSession
from tinyvllm.server.serving import ClientGone, ServerState

# Endpoints anyone may call with --api-key set: load balancers probe it without a key.
_OPEN_PATHS = frozenset({"/health"})
# Status for an answer nobody will read (nginx's "client closed request").
_CLIENT_CLOSED = 499


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`; plain ASGI rather than FastAPI's
    @app.middleware("http"), which wraps every streamed chunk and the client's disconnect
    message in extra tasks and queues."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        what = "wrong API key" if given else "missing API key"
        response = error_response(
            401, f"{what}: send the header `Authorization: Bearer <key>` with the server's key"
        )
        await response(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tinyvllm", version=tinyvllm.__version__)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=state.limits.max_request_body_bytes)
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tinyvllm.__version__}

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in state.model_names])

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> ModelCard:
        state.check_model(name)
        return card(name)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        try:
            return await create_completion(state, req, raw)
        except ClientGone:
            return Response(status_code=_CLIENT_CLOSED)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
        try:
            return await create_chat_completion(state, req, raw)
        except ClientGone:
            return Response(status_code=_CLIENT_CLOSED)

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Any:
        try:
            return await create_embedding(state, req, raw)
        except ClientGone:
            return Response(status_code=_CLIENT_CLOSED)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await _tokenize(state, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(req.model)
        vocab = state.engine.engine.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"tokens {bad[:5]} are outside the vocabulary 0..{vocab - 1}", "tokens"
            )
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await RealtimeSession(websocket, state).run()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_metrics(state.engine.get_stats(), state.metrics, state.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        chat = ChatCompletionRequest(
            messages=req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        prompt = await chat_prompt(state, chat)
        ids = prompt["prompt_token_ids"]
        if "multi_modal_data" in prompt:  # count each image/video as the tokens it becomes
            ids = await _expand_media(state, ids, prompt["multi_modal_data"])
    else:
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    body["token_strs"] = (
        state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    )
    return body


async def _expand_media(state: ServerState, ids: list[int], media: dict[str, Any]) -> list[int]:
    """The prompt ids with each placeholder expanded as the engine would (off the event loop:
    media are decoded and preprocessed)."""
    try:
        expanded, _ = await asyncio.to_thread(state.engine.engine.mm_processor.process, ids, media)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    return expanded
