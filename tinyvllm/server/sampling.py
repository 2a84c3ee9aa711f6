"""From API request fields to `SamplingParams`, and from `Logprob`s back to the API's shapes.

`SamplingParams` validates every value and names the field in its ValueError; that message is
what the client gets in its 400. Values the request leaves out take the checkpoint's
generation_config.json defaults (as vLLM's generation_config="auto"), else vLLM's defaults.
"""

from __future__ import annotations

from typing import Any

from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.server.errors import bad_request
from tinyvllm.server.protocol import (
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
)

# OpenAI's upper bound on top_logprobs (chat) and logprobs (completions).
MAX_LOGPROBS = 20

_PASSTHROUGH = (
    "n",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "prompt_logprobs",
)
# Fields the request may leave out (None): the model's default, then SamplingParams'.
_MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _refuse_unsupported(req: SamplingFields) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by tinyvllm; leave it out", "logit_bias")
    if req.use_beam_search:
        raise bad_request("beam search is not supported by tinyvllm", "use_beam_search")


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: dict[str, Any],
) -> SamplingParams:
    """The request's SamplingParams (DELTA outputs); a bad value is a 400 naming its field."""
    _refuse_unsupported(req)
    values: dict[str, Any] = {name: getattr(req, name) for name in _PASSTHROUGH}
    for name in _MODEL_DEFAULTED:
        value = getattr(req, name)
        if value is not None:
            values[name] = value
        elif name in defaults:
            values[name] = defaults[name]
    try:
        return SamplingParams(
            **values,
            max_tokens=max_tokens,
            logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA,
        )
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), _field_named(str(exc))) from None


def _field_named(message: str) -> str | None:
    # SamplingParams' messages start with the field name ("top_p must be in (0, 1], got 2").
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None


def _check_logprobs(value: int | None, name: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)


def completion_sampling(req: CompletionRequest, defaults: dict[str, Any]) -> SamplingParams:
    _check_logprobs(req.logprobs, "logprobs")
    if req.suffix is not None:
        raise bad_request("suffix is not supported by tinyvllm", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n={req.n} in tinyvllm, got {req.best_of}", "best_of")
    return sampling_params(req, req.max_tokens, req.logprobs, defaults)


def chat_sampling(req: ChatCompletionRequest, defaults: dict[str, Any]) -> SamplingParams:
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(
            "structured output (response_format other than text) is not supported by tinyvllm",
            "response_format",
        )
    if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
        raise bad_request(
            "forced tool calls are not supported by tinyvllm; use tool_choice 'auto' or 'none'",
            "tool_choice",
        )
    _check_logprobs(req.top_logprobs, "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # max_tokens is OpenAI's older name; None lets the answer run to the end of the context.
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    return sampling_params(req, max_tokens, logprobs, defaults)


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The `k` most likely candidates at one position, best first (`entry` holds the sampled
    token first whatever its rank, then the top ones)."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]


def prompt_logprobs_json(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or
    {token_id: {"logprob", "rank", "decoded_token"}}."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tok: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tok, lp in entry.items()
        }
        for entry in entries
    ]


def _text(token_id: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int
) -> list[TokenLogprob]:
    out = []
    for tok, entry in zip(token_ids, entries, strict=False):
        lp = entry[tok]
        text = _text(tok, lp)
        top = [
            TopLogprob(token=_text(t, c), logprob=c.logprob, bytes=list(_text(t, c).encode()))
            for t, c in _ranked(entry, k)
        ]
        out.append(
            TokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return out


def extend_completion_logprobs(
    into: CompletionLogprobs,
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    k: int,
    text_start: int,
) -> int:
    """Append one delta's tokens to `into`; returns the text offset after them."""
    offset = text_start
    for tok, entry in zip(token_ids, entries, strict=False):
        lp = entry[tok]
        text = _text(tok, lp)
        into.tokens.append(text)
        into.token_logprobs.append(lp.logprob)
        into.text_offset.append(offset)
        top = {_text(t, c): c.logprob for t, c in _ranked(entry, k)}
        into.top_logprobs.append(top or None)
        offset += len(text)
    return offset
