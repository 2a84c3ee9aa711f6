"""ChatSession: one conversation over an AsyncLLM, shared by the REPL and the TUI.

It owns the history, applies the tokenizer's chat template the way `LLM.chat` does, streams
text deltas, keeps a partial answer when a turn is stopped, and trims the oldest turns when
the conversation outgrows the model's context.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyvllm.chat.defaults import default_chat_params
from tinyvllm.engine.engine import check_text
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.utils.chat_template import render_chat_template
from tinyvllm.utils.content_parts import PLACEHOLDERS, split_content_parts

if TYPE_CHECKING:
    from tinyvllm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# Sampling fields `/set` may change, with the type each value is parsed as.
SETTABLE_PARAMS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "max_tokens": int,
    "min_tokens": int,
    "seed": int,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}
# Fields that accept "none" (no limit / no seed).
_NULLABLE = frozenset({"max_tokens", "seed"})
# Room kept for the answer when trimming history, if max_tokens does not say.
_DEFAULT_ANSWER_ROOM = 256

Message = dict[str, Any]


@dataclass(frozen=True)
class TurnSummary:
    """Numbers for one answer; timings measured by the engine's clock."""

    prompt_tokens: int
    completion_tokens: int
    tokens_per_s: float  # decode speed: tokens after the first over the time they took
    ttft_s: float | None  # time to first token, from arrival
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    dropped_turns: int = 0  # old turns trimmed to fit the context before this one

    def line(self) -> str:
        parts = [f"{self.completion_tokens} tokens", f"{self.tokens_per_s:.1f} tok/s"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s:.2f} s")
        parts.append(f"prompt {self.prompt_tokens} tokens")
        reason = {"abort": "stopped", "length": "hit the token limit", "error": "failed"}
        if self.finish_reason in reason:
            parts.append(reason[self.finish_reason])
        if self.dropped_turns:
            parts.append(f"{self.dropped_turns} old turn(s) dropped")
        return "[" + ", ".join(parts) + "]"


class ChatSession:
    """A conversation: `async for delta in session.send("Hi"): ...`.

    `messages` holds the user/assistant turns (the system prompt lives in `system`); an
    assistant message whose answer was stopped carries `"stopped": True`. `stop()` may be
    called from any thread or a signal handler. `notice` receives one-line messages such as
    "dropped 2 old turns" (default: logged as warnings).
    """

    def __init__(
        self,
        llm: AsyncLLM,
        params: SamplingParams | None = None,
        system: str | None = None,
        *,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.llm = llm
        # Default: the checkpoint's generation_config values, else tinyvllm's (chat/defaults.py).
        base = params if params is not None else default_chat_params(llm)
        # Kept as plain settings and rebuilt on every change: SamplingParams resets top_p and
        # friends while greedy, and a later /set temperature must not lose what the user set.
        self._settings = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
        self._settings["output_kind"] = RequestOutputKind.DELTA
        self.params = SamplingParams(**self._settings)
        self.messages: list[Message] = []
        self.system = system
        self.notice = notice or logger.warning
        self._request_id: str | None = None
        # The request stop() was called for: text the engine made after that is not shown.
        self._stopped_id: str | None = None
        # Bumped by reset(): a turn still streaming then must not write into the new history.
        self._epoch = 0
        self.last_turn: TurnSummary | None = None

    # ---- conversation state -----------------------------------------------------------------
    @property
    def system(self) -> str | None:
        return self._system

    @system.setter
    def system(self, text: str | None) -> None:
        self._system = check_text(text, "the system prompt") if text else None

    @property
    def busy(self) -> bool:
        """True while an answer is streaming."""
        return self._request_id is not None

    def reset(self) -> None:
        """Forget the conversation (the system prompt and sampling settings stay)."""
        if self.busy:
            self.stop()
        self._epoch += 1
        self.messages.clear()
        self.last_turn = None

    def conversation(self) -> list[dict[str, str]]:
        """What the chat template sees: the system prompt, then every turn (role + content)."""
        return self._template_input(self.messages)

    def _template_input(self, messages: list[Message]) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self._system}] if self._system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in messages]

    # ---- sampling settings ------------------------------------------------------------------
    def set_param(self, key: str, value: Any = None) -> None:
        """Change one sampling setting: `set_param("temperature", "0.7")`, or
        `set_param("temperature=0.7")`. Raises ValueError naming the valid settings or
        the allowed range."""
        if value is None and "=" in key:
            key, value = key.split("=", 1)
        key = key.strip().replace("-", "_")
        if key not in SETTABLE_PARAMS:
            raise ValueError(
                f"unknown setting {key!r}; valid settings: {', '.join(SETTABLE_PARAMS)}"
            )
        if value is None:
            raise ValueError(f"give {key} a value, e.g. {key}={self._settings[key]}")
        parsed = _parse_value(key, value)
        settings = {**self._settings, key: parsed}
        self.params = SamplingParams(**settings)  # raises ValueError naming the field
        self._settings = settings

    def settings(self) -> dict[str, Any]:
        """The current values of the settable sampling fields."""
        return {key: self._settings[key] for key in SETTABLE_PARAMS}

    # ---- one turn ---------------------------------------------------------------------------
    async def send(self, text: str | list[dict[str, Any]]) -> AsyncIterator[str]:
        """Add a user turn and stream the answer's text deltas.

        `text` may be a list of OpenAI-style content parts (text, image_url, video_url, or
        in-memory image / video) for vision-language models; the media stay attached to the
        turn for the rest of the conversation.

        The answer joins the history when the stream ends, also when it was stopped (then
        marked `"stopped": True`). If the engine fails, the user turn is taken back and the
        error raised. Raises ValueError for a message that cannot fit the context at all.
        """
        if self.busy:
            raise RuntimeError("an answer is still streaming; stop() it first")
        message: Message = {"role": "user"}
        if isinstance(text, str):
            message["content"] = check_text(text, "the message")
        else:
            processor = getattr(self.llm.engine, "mm_processor", None)
            placeholders = getattr(processor, "placeholders", PLACEHOLDERS)
            user = {"role": "user", "content": text}
            [flat], media = split_content_parts([user], placeholders)
            message["content"] = check_text(flat["content"], "the message")
            if media:
                message["media"] = media
        self.messages.append(message)
        try:
            prompt, dropped = self._prompt()
        except BaseException:
            self.messages.pop()
            raise
        request_id = f"chat-{uuid.uuid4().hex[:12]}"
        self._request_id, epoch = request_id, self._epoch
        pieces: list[str] = []
        last: Any = None
        failed = held_back = False
        try:
            async for out in self.llm.generate(prompt, self.params, request_id=request_id):
                last = out
                delta = out.outputs[0].text
                if delta and self._stopped_id == request_id:
                    # Steps already made when the abort lands: the user stopped before them.
                    held_back = True
                elif delta:
                    pieces.append(delta)
                    yield delta
        except Exception:
            failed = True
            if epoch == self._epoch:
                self.messages.pop()
            raise
        finally:
            # Runs also when the consumer leaves early (the stream then aborts the request).
            self._request_id = None
            if not failed and epoch == self._epoch:
                self._finish_turn("".join(pieces), last, dropped, held_back)

    def stop(self) -> None:
        """Abort the answer being streamed (thread-safe; a no-op when idle)."""
        request_id = self._request_id
        if request_id is not None:
            self._stopped_id = request_id
            self.llm.abort(request_id)

    def _finish_turn(self, answer: str, last: Any, dropped: int, held_back: bool) -> None:
        # A stop() that lost the race with the last token leaves a complete answer, unless
        # text after the stop was held back.
        finish = last.outputs[0].finish_reason if last is not None else None
        message: Message = {"role": "assistant", "content": answer}
        if finish in (None, "abort") or held_back:
            message["stopped"] = True
            finish = "abort"
        self.messages.append(message)
        self.last_turn = _summary(last, finish, dropped)

    # ---- prompt building --------------------------------------------------------------------
    def _prompt(self) -> tuple[dict[str, Any], int]:
        """The templated prompt of the whole conversation; drops the oldest turns (never the
        system prompt or the new message) while it leaves too little room for the answer."""
        tokenizer = self.llm.get_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template, so it cannot chat; use "
                "`tinyvllm generate` for plain completion"
            )
        max_len = self.llm.engine.config.model.max_model_len
        limit = max_len - self._answer_room(max_len)
        # Trim a copy: a message that cannot fit even alone must leave the history intact.
        kept = list(self.messages)
        dropped = 0
        while True:
            text = render_chat_template(tokenizer, self._template_input(kept))
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= limit:
                break
            if len(kept) <= 1:
                raise ValueError(
                    f"the message is {len(ids)} tokens with the chat template, but the model "
                    f"holds {max_len} tokens and needs room to answer; send a shorter message"
                )
            # A turn is a user message and the assistant answer after it.
            del kept[0]
            if len(kept) > 1 and kept[0]["role"] == "assistant":
                del kept[0]
            dropped += 1
        if dropped:
            self.messages[:] = kept
            self.notice(
                f"dropped the {dropped} oldest turn(s) so the conversation fits the "
                f"{max_len}-token context"
            )
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        media = _collect_media(kept)
        if media:
            prompt["multi_modal_data"] = media
        return prompt, dropped

    def _answer_room(self, max_len: int) -> int:
        wanted = self.params.max_tokens or _DEFAULT_ANSWER_ROOM
        return max(1, min(wanted, max_len // 2))

    # ---- transcripts ------------------------------------------------------------------------
    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the conversation: Markdown for `.md` / `.markdown`, JSON otherwise.

        Raises FileExistsError if `path` exists and `overwrite` is False, and never follows a
        symbolic link at `path` (OSError), so a transcript cannot be steered onto another file.
        """
        path = Path(path).expanduser()
        if path.suffix.lower() in (".md", ".markdown"):
            text = self._markdown()
        else:
            data = {
                "system": self._system,
                # Media (arrays, images) are not JSON: the text keeps their placeholders.
                "messages": [{k: v for k, v in m.items() if k != "media"} for m in self.messages],
                "params": self.settings(),
            }
            text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
        _write_new(path, text, overwrite)
        return path

    def _markdown(self) -> str:
        blocks = ["# Chat transcript"]
        if self._system:
            blocks.append(f"**system:** {self._system}")
        for m in self.messages:
            mark = " *(stopped)*" if m.get("stopped") else ""
            blocks.append(f"**{m['role']}:**{mark}\n\n{m['content']}")
        return "\n\n".join(blocks) + "\n"


def _collect_media(messages: list[Message]) -> dict[str, list[Any]]:
    """The kept turns' media, per modality in conversation order (as their placeholders)."""
    media: dict[str, list[Any]] = {}
    for message in messages:
        for modality, items in message.get("media", {}).items():
            media.setdefault(modality, []).extend(items)
    return media


def _write_new(path: Path, text: str, overwrite: bool) -> None:
    # O_EXCL fails on any existing name, a dangling symlink included; O_NOFOLLOW makes an
    # allowed overwrite fail on a symlink instead of writing through it.
    if path.is_symlink():
        raise OSError(errno.ELOOP, f"{path} is a symbolic link; not following it", str(path))
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_TRUNC if overwrite else os.O_EXCL
    fd = os.open(path, flags, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def _parse_value(key: str, value: Any) -> Any:
    kind = SETTABLE_PARAMS[key]
    if isinstance(value, str):
        value = value.strip()
        if value.lower() in ("none", "null", "") and key in _NULLABLE:
            return None
        try:
            return kind(value)
        except ValueError:
            raise ValueError(
                f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
            ) from None
    if value is None and key in _NULLABLE:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if kind is int and float(value) != int(value):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return kind(value)


def _summary(last: Any, finish: str | None, dropped: int) -> TurnSummary:
    metrics = getattr(last, "metrics", None)
    prompt = len(last.prompt_token_ids) if last is not None else 0
    completion = metrics.num_generation_tokens if metrics is not None else 0
    ttft = metrics.ttft if metrics is not None else None
    rate = 0.0
    first = metrics.first_token_time if metrics is not None else None
    end = metrics.last_token_time if metrics is not None else None
    if first is not None and end is not None and completion > 1 and end > first:
        # The first token's time is prefill; decode speed is what the user watches stream.
        rate = (completion - 1) / (end - first)
    return TurnSummary(prompt, completion, rate, ttft, finish, dropped)
