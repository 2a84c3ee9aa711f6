"""POST /v1/embeddings: pooling models only.

The engine's `embed(prompt, request_id=..., truncate_prompt_tokens=..., normalize=...)`
returns vLLM's EmbeddingRequestOutput shape (`.outputs.embedding`, `.prompt_token_ids`). A
generative engine has no pooling runner, so the request is refused with a 400 saying how to
start an embedding server instead.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from fastapi import Request

from tinyvllm.server.errors import bad_request
from tinyvllm.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from tinyvllm.server.serving import (
    ServerState,
    counted_request,
    engine_prompts,
    new_id,
    unless_disconnected,
)


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def create_embedding(
    state: ServerState, req: EmbeddingRequest, raw: Request
) -> EmbeddingResponse:
    state.check_model(req.model)
    embed = getattr(state.engine, "embed", None)
    if embed is None or not state.is_pooling:
        raise bad_request(
            f"the model `{state.model_name}` is not an embedding model: this server runs it "
            "for generation; start an embedding server with `tinyvllm serve MODEL "
            "--runner pooling`",
            "model",
        )
    if req.dimensions is not None:
        raise bad_request("dimensions is not supported by tinyvllm; leave it out", "dimensions")
    request_id = new_id("embd")
    inputs = engine_prompts(req.input, "input")

    async def one(i: int, prompt: Any) -> Any:
        # One request per input, counted as the generating routes count theirs.
        with counted_request(state.metrics, "input") as outcome:
            out = await embed(
                prompt,
                request_id=f"{request_id}-{i}",
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                normalize=req.normalize,
            )
            outcome.reason = "stop"  # a pooling request ends with its one forward pass
            return out

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(inputs)]
    try:
        outputs = await unless_disconnected(raw, asyncio.gather(*tasks))
    finally:
        # One failed prompt (or a client gone) aborts the batch's other prompts.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    data = [
        EmbeddingData(index=i, embedding=_encode(list(out.outputs.embedding), req.encoding_format))
        for i, out in enumerate(outputs)
    ]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens)
    return EmbeddingResponse(id=request_id, model=state.model_name, data=data, usage=usage)
