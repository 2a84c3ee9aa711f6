"""Incremental detokenization with stop strings and streaming hold-back.

Text is produced by decoding a small sliding window of token ids each step (prefix_offset /
read_offset, as in vLLM): the window starts at the last point where decoded text was emitted,
so each step costs O(window), not O(output). A step whose window text ends in U+FFFD is an
incomplete UTF-8 character split across byte-level tokens; it emits nothing until the bytes
complete, so streams never show a replacement character that the final text would not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

# Prompt tokens that seed the window: enough context for the first output token to decode as
# it would mid-text (sentencepiece drops the leading space of a window's first token).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def decode_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token on its own, for `Logprob.decoded_token`.

    A token that holds part of a multi-byte character decodes to U+FFFD; this is what vLLM
    reports too.
    """
    return tokenizer.decode(
        [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `tokenizer.decode(..., skip_special_tokens=True)` drops.

    Compute once per tokenizer and pass to `IncrementalDetokenizer` to save the lookup per
    request. For a fast tokenizer this is the backend's own set of special added tokens, which
    can be larger than `all_special_ids` (e.g. chat-template markers).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        added = backend.get_added_tokens_decoder()
        return frozenset(i for i, tok in added.items() if tok.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class IncrementalDetokenizer:
    """Turns one completion's token ids into text, step by step.

    The concatenation of all streamed text equals `tokenizer.decode(output_ids,
    skip_special_tokens=...)` for byte-level BPE tokenizers, except that text from a stop
    string on is cut, and the token that ended the request through EOS / `stop_token_ids`
    is left out (both unless `include_stop_str_in_output`). With sentencepiece tokenizers the
    first token keeps its leading space, as it would inside `decode(prompt + output)`.
    Tokenization-space cleanup is never applied: it is not local to a window.
    """

    def __init__(
        self,
        tokenizer: Any | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        special_ids: frozenset[int] | None = None,
    ) -> None:
        assert isinstance(params.stop, list)
        self._stop: tuple[str, ...] = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._skip_special = params.skip_special_tokens
        self._tokenizer = tokenizer
        self._active = params.detokenize and tokenizer is not None
        if self._stop and tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer, got stop={list(self._stop)!r}")

        self._text = ""  # all text so far, cut at a matched stop string
        self._num_tokens = 0
        self._finished = False
        self._returned = 0  # chars already handed out by get_next_output_text(delta=True)
        self._held = 0  # trailing chars that may still begin a stop string

        # Sliding window: ids from prefix_offset on; window[:read] is already emitted text.
        self._window: list[int] = []
        self._read = 0
        self._prefix_text: str | None = ""
        self._skip_ids: frozenset[int] = frozenset()
        # Updates not applied yet (see `update`): (token ids, finished, stop_terminated).
        self._pending: list[tuple[list[int], bool, bool]] = []
        self._defer = (
            self._active and not self._stop and params.output_kind == RequestOutputKind.FINAL_ONLY
        )
        if not self._active:
            return
        if self._skip_special:
            self._skip_ids = special_token_ids(tokenizer) if special_ids is None else special_ids
        self._seed(prompt_token_ids)

    # ---- public API --------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        self._catch_up()
        return self._finished

    @property
    def output_text(self) -> str:
        """All text so far, without the trailing chars that may still begin a stop string."""
        return self.get_next_output_text(finished=False, delta=False)

    def update(
        self, new_token_ids: Sequence[int], finished: bool = False, stop_terminated: bool = False
    ) -> str | None:
        """Append new tokens; return the stop string if one matched (the request is then done).

        `finished`: the engine ends the request after these tokens (length, abort), so bytes of
        an incomplete character are flushed as U+FFFD, matching a full decode.
        `stop_terminated`: the last token is EOS or one of `stop_token_ids`; its text is left
        out unless `include_stop_str_in_output`. Implies `finished`.

        A final-only request without stop strings needs no text before its last update (no
        text can end it, none is handed out): its updates wait and then run back to back,
        while their code and the tokenizer's tables are in the caches, instead of once per
        decode step after the model has evicted them (~40 us of a ~7 ms SmolLM2 step at batch
        1). The text is the same either way; a tokenizer that fails to decode then fails at
        the last update rather than at the token it cannot decode.
        """
        if self._defer:
            if not (finished or stop_terminated):
                self._pending.append((list(new_token_ids), finished, stop_terminated))
                return None
            self._catch_up()
        return self._apply(new_token_ids, finished, stop_terminated)

    def _catch_up(self) -> None:
        pending, self._pending = self._pending, []
        for ids, finished, stop_terminated in pending:
            self._apply(ids, finished, stop_terminated)

    def _apply(
        self, new_token_ids: Sequence[int], finished: bool, stop_terminated: bool
    ) -> str | None:
        if self._finished:
            return None
        finished = finished or stop_terminated
        if not self._active:
            self._num_tokens += len(new_token_ids)
            self._finished = finished
            return None

        ids = list(new_token_ids)
        skipped_stop_token = stop_terminated and not self._include_stop and bool(ids)
        if skipped_stop_token:
            ids.pop()
        # Stop strings may only end in text produced after min_tokens tokens (as vLLM).
        check_from = len(self._text)
        pieces = [self._text]
        for token_id in ids:
            self._num_tokens += 1
            piece = self._decode_next(token_id)
            pieces.append(piece)
            if self._num_tokens <= self._min_tokens:
                check_from += len(piece)
        self._num_tokens += int(skipped_stop_token)
        if finished:
            pieces.append(self._flush())
        self._text = "".join(pieces)

        stop_str = None
        if self._stop and self._num_tokens > self._min_tokens:
            stop_str = self._truncate_at_stop(check_from)
        self._finished = finished or stop_str is not None
        self._held = 0 if self._finished else self._stop_prefix_len()
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to put in the next `CompletionOutput`.

        `delta=False`: everything so far; `delta=True`: only what earlier calls with delta=True
        did not return. Unless the request is finished, the trailing chars that could still
        begin a stop string are held back, so a partial stop string never reaches a stream.
        """
        if self._pending:
            self._catch_up()
        end = len(self._text) if finished or self._finished else len(self._text) - self._held
        if not delta:
            return self._text[:end]
        start = self._returned
        if end <= start:
            return ""
        self._returned = end
        return self._text[start:end]

    # ---- decoding ----------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _seed(self, prompt_token_ids: Sequence[int]) -> None:
        seed: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(seed) == _PROMPT_CONTEXT_TOKENS:
                break
            if token_id not in self._skip_ids:
                seed.append(token_id)
        seed.reverse()
        text = self._decode(seed) if seed else ""
        if text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character. Emitted text must start at a character
            # boundary to equal decode(output_ids), so start without context instead.
            seed, text = [], ""
        self._window = seed
        self._read = len(seed)
        self._prefix_text = text

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skip_ids:
            # Dropping skipped specials from the window keeps it small when a model emits
            # many of them (ignore_eos benchmarks); decode() would drop them anyway.
            return ""
        self._window.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""  # no new text yet, or an incomplete character: wait for more bytes
        return self._advance(text)

    def _flush(self) -> str:
        if self._read == len(self._window):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        return self._advance(self._decode(self._window))

    def _advance(self, text: str) -> str:
        assert self._prefix_text is not None
        new_text = text[len(self._prefix_text) :]
        # The emitted tokens become the next prefix; the window ends on a character boundary.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = None
        return new_text

    # ---- stop strings ------------------------------------------------------------------------

    def _truncate_at_stop(self, check_from: int) -> str | None:
        """Cut the text at the first stop string ending after `check_from`; return it."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            # Only matches ending in unchecked text: older text was searched in earlier steps.
            start = self._text.find(stop, max(0, check_from - len(stop) + 1))
            if start < 0:
                continue
            # The earliest *end* wins: that is the match a token-by-token stream would hit
            # first, so the result does not depend on how many tokens arrive per step.
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop = best
        self._text = self._text[: end if self._include_stop else start]
        return stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        if not self._stop or self._include_stop:
            # An included stop string stays in the output, so no text can be retracted.
            return 0
        longest = max(len(s) for s in self._stop) - 1
        for k in range(min(longest, len(self._text)), 0, -1):
            suffix = self._text[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in self._stop):
                return k
        return 0
