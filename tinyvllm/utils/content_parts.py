"""OpenAI-style message content parts -> text for the chat template plus the media.

`{"role": "user", "content": [{"type": "text", "text": "What is here?"},
{"type": "image_url", "image_url": {"url": "file:///tmp/cat.png"}}]}` becomes the text
"What is here?<image placeholder>" and one image in `multi_modal_data`, in order. Media stay
as given (a path, file:// or data: URL, bytes, an array, PIL images); the engine loads and
checks them. Plain string contents pass through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# What stands for one item in the prompt (Qwen-VL's vision tokens).
PLACEHOLDERS: Mapping[str, str] = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}
# Part type -> (modality, key holding the item).
_MEDIA_PARTS: Mapping[str, tuple[str, str]] = {
    "image_url": ("image", "image_url"),
    "image": ("image", "image"),
    "image_pil": ("image", "image_pil"),
    "video_url": ("video", "video_url"),
    "video": ("video", "video"),
}


def split_content_parts(
    messages: Sequence[Mapping[str, Any]], placeholders: Mapping[str, str] = PLACEHOLDERS
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """(messages whose content is text, multi_modal_data in prompt order; {} for text).
    `placeholders`: the model's text for one item per modality (the model's processor's
    `placeholders`; Qwen-VL's by default)."""
    media: dict[str, list[Any]] = {}
    flat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) or content is None:
            flat.append(dict(message))
            continue
        if not isinstance(content, Sequence):
            raise ValueError(
                f"message {i}: content must be a string or a list of content parts, got "
                f"{type(content).__name__}"
            )
        texts: list[str] = []
        for part in content:
            texts.append(_part_text(part, i, media, placeholders))
        flat.append({**message, "content": "".join(texts)})
    return flat, media


def _part_text(
    part: Any, index: int, media: dict[str, list[Any]], placeholders: Mapping[str, str]
) -> str:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text":
        return str(part.get("text", ""))
    if kind not in _MEDIA_PARTS:
        known = ", ".join(["text", *_MEDIA_PARTS])
        raise ValueError(f"message {index}: unknown content part type {kind!r}; known: {known}")
    modality, key = _MEDIA_PARTS[kind]
    value = part.get(key)
    if isinstance(value, Mapping):  # {"url": ...} as OpenAI sends it
        value = value.get("url")
    if value is None:
        raise ValueError(f"message {index}: the {kind} part has no {key!r} value")
    media.setdefault(modality, []).append(value)
    if modality not in placeholders:
        raise ValueError(f"message {index}: this model does not take {modality} parts")
    return placeholders[modality]
