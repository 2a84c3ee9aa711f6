"""What chat templates may call besides Jinja's builtins, as transformers provides it.

Templates are written against `tokenizer.apply_chat_template`, which adds a few globals
(`raise_exception`, `strftime_now`, a `dict` and a `namespace` that refuse private names), its
own `tojson` filter, the `loopcontrols` extension and a `{% generation %}` tag. When transformers
is already imported `utils.chat_template` borrows its environment; otherwise (a GGUF model runs
without transformers) it uses these, which render the same (tests/test_gguf_startup.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

# Where a message's reasoning may arrive; templates read the first name.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike Jinja's own filter: no HTML escaping, and json.dumps's layout options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """`dict(...)` for templates, without the class's attributes to reach through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # `self` may also be a keyword
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
        )


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part for training masks;
    rendering a prompt only needs its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


TEMPLATE_EXTENSIONS: tuple[Any, ...] = (GenerationTag, jinja2.ext.loopcontrols)
TEMPLATE_FILTERS: Mapping[str, Callable[..., Any]] = {"tojson": _tojson}
TEMPLATE_GLOBALS: Mapping[str, Any] = {
    "raise_exception": _raise_exception,
    "strftime_now": _strftime_now,
    "dict": _TemplateDict(),
    "namespace": _TemplateNamespace,
}


def plain_template_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON-like types; any other object becomes "<TypeName>".

    Templates are untrusted code and rich objects (images, arrays) carry methods the sandbox
    does not know to block; templates only test such values for presence.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums, numpy scalars) are cut back to the base type and lose their methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    numpy = sys.modules.get("numpy")  # not imported: no numpy values to meet
    if numpy is not None and isinstance(value, numpy.generic):
        return plain_template_data(value.item())  # np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return {f.name: plain_template_data(getattr(value, f.name)) for f in fields}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (OpenAI SDK messages)
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def alias_reasoning_fields(chat: list[Any]) -> list[Any]:
    """Messages with reasoning under any known name also carry it as `reasoning_content` and
    `thinking`, the names templates read."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next(
                (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out
