"""Prompts as the engine takes them: tokenizing, id and text checks, and request ids."""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

PromptType = str | dict[str, Any] | list[int]


def claim_request_id(request_id: str | None, in_use: Container[str], counter: Iterator[int]) -> str:
    """`request_id` checked to be a free str, or (None) the next free number from `counter`."""
    if request_id is None:
        request_id = str(next(counter))
        while request_id in in_use:  # a caller chose this one
            request_id = str(next(counter))
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if request_id in in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    return request_id


def tokenize_prompt(
    tokenizer: Any, prompt: PromptType, truncate_to: int | None = None
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids). With `truncate_to` at most that many tokens are kept:
    text is truncated by the tokenizer (its truncation side, special tokens kept), token ids
    keep the last `truncate_to` (vLLM's rule)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer, but the engine was started with "
                "skip_tokenizer_init=True; pass {'prompt_token_ids': [...]} instead"
            )
        text = check_text(prompt)
        if truncate_to is None:
            return prompt, list(tokenizer.encode(text))
        return prompt, list(tokenizer.encode(text, truncation=True, max_length=truncate_to))
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            return prompt.get("prompt"), ids if truncate_to is None else ids[-truncate_to:]
        if "prompt" in prompt:
            return tokenize_prompt(tokenizer, prompt["prompt"], truncate_to)
        raise ValueError(
            f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
        )
    if isinstance(prompt, list | tuple):
        return None, list(prompt) if truncate_to is None else list(prompt)[-truncate_to:]
    raise TypeError(
        f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}"
    )


def check_token_ids(prompt_ids: list[int], vocab: int) -> None:
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"prompt_token_ids contains out-of-vocabulary id(s) {bad[:5]}; "
            f"valid ids are 0..{vocab - 1}"
        )


def child_request_id(request_id: str, index: int) -> str:
    """The internal id of sample `index` of a request (its only sequence when n = 1).

    Every sequence gets one, so no user id can equal another request's internal id: the part
    after the last '#' is always the index, which makes the mapping one-to-one.
    """
    return f"{request_id}#{index}"


def check_text(text: str, what: str = "the prompt") -> str:
    """`text` if UTF-8 can encode it, else ValueError. Lone surrogates (undecodable bytes read
    with errors="surrogateescape", or a broken escape) would reach the tokenizer as a bare
    TypeError about TextEncodeInput."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise ValueError(
            f"{what} is not valid Unicode text: {bad!r} at character {exc.start} is a lone "
            "surrogate, which UTF-8 cannot encode (often undecodable bytes in the input); "
            "remove it or decode the input with errors='replace'"
        ) from None
    return text
