"""Rendering chat templates, which come from model files, with bounded time and output.

A template is code from whoever made the file. Jinja's immutable sandbox keeps it away from
Python internals, but not from spending: a nested loop runs for hours and `'x' * 10**10` or
`s ~ s` doubled in a loop fill memory. Here every template frame runs under a deadline (a
per-thread trace hook, so it works in the engine's and the TUI's worker threads too), and
string/list growth, large numeric arguments and the rendered output are capped.

The environment copies transformers' settings, globals and filters (`raise_exception`,
`strftime_now`, `tojson`, its hardened `dict` and `namespace`), so templates render as
`tokenizer.apply_chat_template` renders them: borrowed from transformers when it is imported,
else tinyvllm's own (`utils.template_env`).
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinyvllm.utils.template_env import (
    TEMPLATE_EXTENSIONS,
    TEMPLATE_FILTERS,
    TEMPLATE_GLOBALS,
    alias_reasoning_fields,
    plain_template_data,
)

# Compiled template code runs in frames with this file name (Environment.from_string).
_TEMPLATE_FILE = "<template>"
# Names the compiled module imports from jinja2.runtime for `a ~ b`.
_JOIN_NAMES = ("str_join", "markup_join")
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = 5.0
    max_chars: int = 4 << 20  # of the output and of any string or list made on the way


class ChatTemplateError(ValueError):
    """A chat template failed, or went past its time or size limit."""


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    # Intercepted operators are also never folded at compile time, so `'x' * 10**10` in the
    # source cannot allocate while compiling.
    intercepted_binops = frozenset({"*", "**", "+", "//", "%"})

    def __init__(self, limits: TemplateLimits, extensions: Sequence[Any] = ()) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=list(extensions))
        self.limits = limits

    def too_big(self, what: str, size: int) -> ChatTemplateError:
        return ChatTemplateError(
            f"the chat template makes {what} of {size} items, over the limit of "
            f"{self.limits.max_chars}"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        cap = self.limits.max_chars
        size = 0
        if operator == "*":
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                size = len(seq) * count
        elif operator == "+" and all(isinstance(x, (str, list, tuple)) for x in (left, right)):
            size = len(left) + len(right)
        elif operator == "**" and isinstance(right, int) and abs(right) > 256:
            raise ChatTemplateError(f"the chat template raises to the power {right}, over 256")
        elif operator == "%" and isinstance(left, str):
            self.check_format(left)
        if size > cap:
            raise self.too_big("a sequence", size)
        return super().call_binop(context, operator, left, right)

    def check_args(self, args: Sequence[Any]) -> None:
        # Widths and counts (`center(10**9)`, `indent(10**9)`) allocate in one C call.
        for value in args:
            if isinstance(value, int) and abs(value) > self.limits.max_chars:
                raise ChatTemplateError(
                    f"the chat template passes {value} to a function, over the limit of "
                    f"{self.limits.max_chars}"
                )

    def check_format(self, spec: str) -> None:
        """Widths in a format string (`'%099999999d'`, `'{:>99999999}'`) allocate in one go."""
        cap = self.limits.max_chars
        for number in _NUMBER.findall(spec):
            number = number.lstrip("0") or "0"
            if len(number) > len(str(cap)) or int(number) > cap:
                raise ChatTemplateError(
                    f"the chat template formats with width {number[:20]}, over the limit of {cap}"
                )

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # `value` is a bound str.format / format_map
            self.check_format(value.__self__)
        return wrapped

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.check_args((*args, *kwargs.values()))
        return super().call(__context, __obj, *args, **kwargs)

    def add_filters(self, filters: Mapping[str, Callable[..., Any]]) -> None:
        """Filters are called directly, not through `call`: check their arguments too."""
        for name, fn in filters.items():
            self.filters[name] = _checked_filter(fn, self, format_first=name == "format")

    def compile_template(self, source: str) -> Any:
        template = self.from_string(source)
        namespace = template.root_render_func.__globals__
        for name in _JOIN_NAMES:
            namespace[name] = _checked_join(namespace[name], self)
        return template


def _checked_filter(
    fn: Callable[..., Any], env: _LimitedSandbox, format_first: bool
) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def checked(*args: Any, **kwargs: Any) -> Any:
        env.check_args((*args, *kwargs.values()))
        if format_first and args and isinstance(args[0], str):
            env.check_format(args[0])  # `'%0999999999d' | format(1)`
        return fn(*args, **kwargs)

    return checked


def _checked_join(join: Callable[[Any], str], env: _LimitedSandbox) -> Callable[[Any], str]:
    def checked(parts: Any) -> str:
        out = join(parts)
        if len(out) > env.limits.max_chars:
            raise env.too_big("a string", len(out))
        return out

    return checked


def _transformers_environment() -> Any:
    """transformers' own template environment (for its globals, filters and extensions), when
    transformers is already imported (importing it only for this costs seconds)."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - transformers without chat template helpers
        return None
    return _compile_jinja_template("").environment


@functools.lru_cache(maxsize=16)
def _compile(source: str, limits: TemplateLimits) -> Any:
    reference = _transformers_environment()
    if reference is None:
        extensions: list[Any] = list(TEMPLATE_EXTENSIONS)
        globals_, filters = TEMPLATE_GLOBALS, TEMPLATE_FILTERS
    else:
        extensions = [type(e) for e in reference.extensions.values()]
        globals_, filters = reference.globals, reference.filters
    env = _LimitedSandbox(limits, extensions)
    env.globals.update(globals_)
    env.globals.pop("lipsum", None)  # paragraphs of filler, `lipsum(10**6)` in one call
    env.add_filters({**env.filters, **filters})
    try:
        with _Deadline(limits.seconds):
            return env.compile_template(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {exc}") from None


class _Deadline:
    """Raise ChatTemplateError in template code running past `seconds` (this thread only)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = 0.0
        self.previous: Any = None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > self.end:
            raise ChatTemplateError(
                f"the chat template ran longer than {self.seconds:g} s (a runaway loop?)"
            )
        return self._line

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self._line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    def __enter__(self) -> None:
        self.end = time.monotonic() + self.seconds
        self.previous = sys.gettrace()
        sys.settrace(self._call)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)


def _template_data(value: Any) -> Any:
    """The conversation as the plain data transformers hands its templates."""
    if "transformers" not in sys.modules:
        return plain_template_data(value)
    try:
        from transformers.utils import chat_template_utils as utils
    except ImportError:  # pragma: no cover
        return value
    plain = getattr(utils, "_plain_template_data", None)
    return value if plain is None else plain(value)


def _alias_reasoning(chat: list[Any]) -> list[Any]:
    if "transformers" not in sys.modules:
        return alias_reasoning_fields(chat)
    try:
        from transformers.utils.chat_template_utils import _alias_reasoning_fields
    except ImportError:  # pragma: no cover - older transformers
        return chat
    return _alias_reasoning_fields(chat)


def render_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    limits: TemplateLimits = TemplateLimits(),
    **kwargs: Any,
) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, ...)` under `limits`.

    Raises ChatTemplateError (a ValueError) for a template that is not valid, raises an
    exception itself (or fails on the data it is given), or runs past the time or size limit.
    """
    source = tokenizer.get_chat_template(chat_template, kwargs.get("tools"))
    template = _compile(source, limits)
    chat = _alias_reasoning(_template_data([dict(m) for m in messages]))
    context = {**tokenizer.special_tokens_map, **_template_data(kwargs)}
    context.setdefault("tools", None)
    context.setdefault("documents", None)
    parts: list[str] = []
    size = 0
    try:
        with _Deadline(limits.seconds):
            gen_prompt = add_generation_prompt and not continue_final_message
            for part in template.generate(
                messages=chat, add_generation_prompt=gen_prompt, **context
            ):
                size += len(part)
                if size > limits.max_chars:
                    raise ChatTemplateError(
                        f"the chat template's output passed {limits.max_chars} characters"
                    )
                parts.append(part)
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from None
    except Exception as exc:
        # Template code can fail like any code (`1 / 0`, `'a' + 1` on a message's content):
        # that is the request's template or data at fault, so the caller's error, not a crash.
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
    text = "".join(parts)
    return _cut_after_final_message(text, chat) if continue_final_message else text


def _cut_after_final_message(text: str, chat: list[dict[str, Any]]) -> str:
    """The prompt ending inside the final message, so the model continues it."""
    final = chat[-1].get("content") if chat else None
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    end = text.rfind(final.strip())
    if end < 0:
        raise ChatTemplateError("the chat template does not render the final message's content")
    return text[: end + len(final.strip())]
