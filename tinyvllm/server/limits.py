"""Bounds on what one request may make the server do, so that no single client (malicious or
mistaken) drives unbounded memory or time and so starves the others.

`ServerLimits` holds them (set from `tinyvllm serve` flags); `BodySizeLimit` enforces the body
size while the body streams in, before any route parses it. The media bounds are applied
where the media are decoded (`tinyvllm.server.chat_media`), the count bounds where a request
becomes engine requests (`tinyvllm.server.serving`, `tinyvllm.server.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyvllm.server.errors import error_response

DEFAULT_MAX_BODY_BYTES = 64 * 2**20
# Pillow's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS' default, ~0.25 GiB RGB).
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
# All the images and kept video frames of one request (a 64 MiB body of well-compressed
# pictures could otherwise decode to tens of GiB): three images of the size above.
DEFAULT_MAX_MEDIA_PIXELS_PER_REQUEST = 3 * DEFAULT_MAX_IMAGE_PIXELS
# Decoded frames (not the sampled ones): 10 minutes at 30 fps.
DEFAULT_MAX_VIDEO_FRAMES = 18_000
# OpenAI's documented maximum for `n`.
MAX_N = 128
# Prompts (completions) or inputs (embeddings) in one request, and sequences one request
# starts (prompts x n): OpenAI's bound on an embeddings input array.
MAX_BATCH = 2048


_COUNTS = (
    "max_request_body_bytes",
    "max_image_pixels",
    "max_media_pixels_per_request",
    "max_video_frames",
)


@dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds; the defaults are what `tinyvllm serve` uses without flags."""

    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # per image and per video frame
    max_media_pixels_per_request: int = DEFAULT_MAX_MEDIA_PIXELS_PER_REQUEST
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    # The only directory file:// media URLs may name (resolved); None refuses file:// URLs.
    allowed_local_media_path: Path | None = None

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} ({name}) must be a positive integer, got {value!r}")
        path = self.allowed_local_media_path
        if path is not None:
            resolved = Path(path).expanduser().resolve()
            if not resolved.is_dir():
                raise ValueError(
                    f"--allowed-local-media-path {str(path)!r} is not a directory; give the "
                    "directory whose files clients may name as file:// URLs"
                )
            object.__setattr__(self, "allowed_local_media_path", resolved)


def limit_names() -> tuple[str, ...]:
    """The count-valued limits, each also a `tinyvllm serve` flag (`--max-...`)."""
    return _COUNTS


class BodySizeLimit:
    """413 for a request body over `max_bytes`: at once when Content-Length says so, else as
    soon as the streamed (e.g. chunked) body passes the bound, so an oversized body is never
    held in memory whole. Plain ASGI, like the API-key check."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(413, self._message(f"Content-Length {int(declared)}"))
            await response(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Routes re-raise an HTTPException met while reading the body (anything
                    # else becomes a 400), and the app's handler answers in OpenAI's shape.
                    raise HTTPException(413, self._message(f"more than {self.max_bytes} bytes"))
            return message

        await self.app(scope, counted_receive, send)

    def _message(self, size: str) -> str:
        return (
            f"the request body ({size}) is larger than this server's limit of "
            f"{self.max_bytes} bytes; send a smaller request (e.g. fewer or smaller images) "
            "or start the server with a larger --max-request-body-bytes"
        )
