"""Chat messages with image and video content parts, as the server accepts them.

`utils.content_parts` turns parts into placeholder text plus `multi_modal_data` (the same path
as `LLM.chat`); this module adds what a network-facing server must check first. Only
`text`, `image_url` and `video_url` parts come over HTTP (an `image` part naming a path would
read any file), and a media URL must be inline (`data:`): a local server does not fetch
http(s) URLs for its clients, so a prompt never makes it reach the network, and `file://` URLs
are refused unless the server was started with `--allowed-local-media-path DIR`, and then
only name files inside DIR (symlinks and `..` resolved first), so a client can neither read
nor probe the rest of the server's disk. Media sent to a text-only model are refused by name
rather than dropped. Items are decoded here (images; videos sampled as the engine samples a
file), in the worker thread that renders the template, so a large upload never stalls the
engine's thread, a broken one is a 400 naming its part, and `ServerLimits`' pixel and frame
bounds are checked before the bulk of the decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from tinyvllm.engine.mm_inputs import VIDEO_FILE_FRAMES
from tinyvllm.multimodal.media import decode_video, load_image, resolve_media
from tinyvllm.server.errors import APIError, bad_request
from tinyvllm.server.limits import ServerLimits
from tinyvllm.utils.content_parts import PLACEHOLDERS, split_content_parts

# Part type -> what it carries, for the messages.
_MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
_INLINE_HINT = (
    'send the file inline as a data: URL ({{"url": "data:{mime};base64,<the file\'s bytes in '
    "base64>\"}}) or, for a file on the server's machine, a file:// URL"
)
_MIMES = {"image": "image/png", "video": "video/mp4"}


@dataclass
class _MediaPolicy:
    """What one request's media may be: the server's limits, and the pixels decoded so far
    (bounded per request, so many small uploads cannot add up to unbounded memory)."""

    limits: ServerLimits
    accepts_media: bool
    model_name: str
    pixels: int = 0

    def count(self, pixels: int, where: str) -> None:
        self.pixels += pixels
        budget = self.limits.max_media_pixels_per_request
        if self.pixels > budget:
            raise bad_request(
                f"{where}: this request's images and video frames come to more than the "
                f"{budget} pixels one request may send; send fewer or smaller ones",
                where,
            )


def chat_messages(
    messages: Sequence[Mapping[str, Any]],
    accepts_media: bool,
    model_name: str,
    limits: ServerLimits,
    placeholders: Mapping[str, str] = PLACEHOLDERS,
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """(messages with text content for the template, multi_modal_data in prompt order; {}
    without media). Raises APIError 400 naming the message and part at fault."""
    policy = _MediaPolicy(limits, accepts_media, model_name)
    checked = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            where = f"messages[{i}].content"
            parts = [_checked_part(part, f"{where}[{j}]", policy) for j, part in enumerate(content)]
            message = {**message, "content": parts}
        checked.append(dict(message))
    try:
        return split_content_parts(checked, placeholders)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def _checked_part(part: Any, where: str, policy: _MediaPolicy) -> Any:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: a text part needs a string `text`", where)
        return part
    if kind not in _MEDIA_PARTS:
        raise bad_request(
            f"{where}: unsupported content part type {kind!r}; the server takes text, "
            "image_url and video_url parts",
            where,
        )
    modality = _MEDIA_PARTS[kind]
    if not policy.accepts_media:
        raise bad_request(
            f"{where}: the model `{policy.model_name}` is text-only and cannot take {modality} "
            "content; send text parts only, or serve a vision-language model (e.g. Qwen2.5-VL)",
            where,
        )
    value = part.get(kind)
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise bad_request(f'{where}: the {kind} part needs {{"url": "..."}}', where)
    return {"type": kind, kind: {"url": _local_media(url, modality, where, policy)}}


def _local_media(url: str, modality: str, where: str, policy: _MediaPolicy) -> Any:
    """The item decoded here, off the engine's thread (this runs with the template, in a
    worker thread): an image, or a video's sampled frames with their frame rate, as the
    engine would decode them; 400 for anything else."""
    scheme = urlparse(url).scheme.lower()
    hint = _INLINE_HINT.format(mime=_MIMES[modality])
    if scheme in ("http", "https"):
        raise bad_request(
            f"{where}: remote {modality} URLs ({url[:60]!r}) are not fetched by this server; "
            f"{hint}",
            where,
        )
    if scheme not in ("data", "file"):
        raise bad_request(
            f"{where}: a {modality} URL must be a data: URL, got {url[:60]!r}; {hint}", where
        )
    limits = policy.limits
    try:
        media = (
            resolve_media(url, modality)
            if scheme == "data"
            else _allowed_file(url, where, limits, hint)
        )
        if modality == "image":
            image = load_image(media, limits.max_image_pixels)
            policy.count(image.width * image.height, where)
            return image
        clip = decode_video(
            media, VIDEO_FILE_FRAMES, limits.max_video_frames, limits.max_image_pixels
        )
        policy.count(clip.frames.size // 3, where)
        return clip.frames, {"fps": clip.fps}
    except (ValueError, OSError, ImportError) as exc:  # ImportError: PyAV missing, says so
        raise APIError(400, f"{where}: {exc}", where) from None


def _allowed_file(url: str, where: str, limits: ServerLimits, hint: str) -> Path:
    """The file a file:// URL names, if it lies inside --allowed-local-media-path once
    symlinks and `..` are resolved. Outside it (or with no such directory) the answer is the
    same whether or not the file exists, so clients cannot probe the disk."""
    allowed = limits.allowed_local_media_path
    if allowed is None:
        raise bad_request(
            f"{where}: file:// URLs are refused by this server (it reads no files for its "
            f"clients unless started with --allowed-local-media-path DIR); {hint}",
            where,
        )
    parsed = urlparse(url)
    path = Path(url2pathname(parsed.path))
    resolved = None
    if parsed.netloc in ("", "localhost") and path.is_absolute():
        try:
            resolved = path.resolve()
        except (ValueError, OSError, RuntimeError):  # a NUL byte, a symlink loop, ...
            resolved = None
    if resolved is None or not resolved.is_relative_to(allowed):
        raise bad_request(
            f"{where}: {url[:80]!r} is not a file:// URL of a file inside the directory this "
            f"server allows (--allowed-local-media-path); {hint}",
            where,
        )
    # The resolved path is what gets opened, so a symlink inside DIR cannot lead out of it.
    return resolved
