"""Chat messages with image and video content parts, as the server accepts them.

`utils.content_parts` turns parts into placeholder text plus `multi_modal_data` (the same path
as `LLM.chat`); this module adds what a network-facing server must check first. Only
`text`, `image_url` and `video_url` parts come over HTTP (an `image` part naming a path would
read any file), and a media URL must be inline (`data:`) or a local `file://` URL: a local
server does not fetch http(s) URLs for its clients, so a prompt never makes it reach the
network. Media sent to a text-only model are refused by name rather than dropped. Items are
decoded here (images; videos sampled as the engine samples a file), in the worker thread that
renders the template, so a large upload never stalls the engine's thread and a broken one is a
400 naming its part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from tinyvllm.engine.mm_inputs import VIDEO_FILE_FRAMES
from tinyvllm.multimodal.media import decode_video, load_image, resolve_media
from tinyvllm.server.errors import APIError, bad_request
from tinyvllm.utils.content_parts import PLACEHOLDERS, split_content_parts

# Part type -> what it carries, for the messages.
_MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
_INLINE_HINT = (
    'send the file inline as a data: URL ({{"url": "data:{mime};base64,<the file\'s bytes in '
    "base64>\"}}) or, for a file on the server's machine, a file:// URL"
)
_MIMES = {"image": "image/png", "video": "video/mp4"}


def chat_messages(
    messages: Sequence[Mapping[str, Any]],
    accepts_media: bool,
    model_name: str,
    placeholders: Mapping[str, str] = PLACEHOLDERS,
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """(messages with text content for the template, multi_modal_data in prompt order; {}
    without media). Raises APIError 400 naming the message and part at fault."""
    checked = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            where = f"messages[{i}].content"
            parts = [
                _checked_part(part, f"{where}[{j}]", accepts_media, model_name)
                for j, part in enumerate(content)
            ]
            message = {**message, "content": parts}
        checked.append(dict(message))
    try:
        return split_content_parts(checked, placeholders)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def _checked_part(part: Any, where: str, accepts_media: bool, model_name: str) -> Any:
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
    if not accepts_media:
        raise bad_request(
            f"{where}: the model `{model_name}` is text-only and cannot take {modality} "
            "content; send text parts only, or serve a vision-language model (e.g. Qwen2.5-VL)",
            where,
        )
    value = part.get(kind)
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise bad_request(f'{where}: the {kind} part needs {{"url": "..."}}', where)
    return {"type": kind, kind: {"url": _local_media(url, modality, where)}}


def _local_media(url: str, modality: str, where: str) -> Any:
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
            f"{where}: a {modality} URL must be a data: or file:// URL, got {url[:60]!r}; {hint}",
            where,
        )
    try:
        media = resolve_media(url, modality)
        if modality == "image":
            return load_image(media)
        clip = decode_video(media, VIDEO_FILE_FRAMES)
        return clip.frames, {"fps": clip.fps}
    except (ValueError, OSError, ImportError) as exc:  # ImportError: PyAV missing, says so
        raise APIError(400, f"{where}: {exc}", where) from None
