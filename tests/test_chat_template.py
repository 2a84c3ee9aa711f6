"""Chat templates come from model files: rendered like transformers renders them, but with a
time and size limit and a clear error instead of a hang or a memory blow-up."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tinyvllm.utils.chat_template import ChatTemplateError, TemplateLimits, render_chat_template

FAST = TemplateLimits(seconds=0.5, max_chars=1 << 20)
# For the output-size case only the size limit may fire: filling 1 MiB takes ~0.2 s on a quiet
# machine but can pass 0.5 s on a loaded one, where the time limit would answer first.
SIZE_ONLY = TemplateLimits(seconds=60.0, max_chars=1 << 20)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "and then?"},
]
# Loop bodies that spend without a function call per iteration.
NESTED_LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
NESTED_OUTPUT = (
    "{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}"
)
DOUBLING = (
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}"
)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(tokenizer: Any, add_generation_prompt: bool) -> None:
    ours = render_chat_template(tokenizer, CHAT, add_generation_prompt=add_generation_prompt)
    theirs = tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_kwargs_special_tokens_and_filters_like_transformers(tokenizer: Any) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m | tojson }}\n"
        "{% endfor %}{% if flag %}[flag]{% endif %}{{ strftime_now('%Y') | length }}"
    )
    kwargs = {"chat_template": template, "flag": True}
    ours = render_chat_template(tokenizer, CHAT, **kwargs)
    assert ours == tokenizer.apply_chat_template(CHAT, tokenize=False, **kwargs)


def test_continue_final_message(tokenizer: Any) -> None:
    chat = [*CHAT[:2], {"role": "assistant", "content": "The answer is"}]
    ours = render_chat_template(tokenizer, chat, continue_final_message=True)
    theirs = tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert ours == theirs and ours.endswith("The answer is")


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        (NESTED_LOOP, "ran longer than 0.5 s"),
        (NESTED_OUTPUT, "output passed"),
        (DOUBLING, "a string of"),
        ("{{ 'x' * 10**10 }}", "a sequence of"),
        ("{{ 'a' | center(10**10) }}", "passes 10000000000"),
        ("{{ '%0999999999d' % 1 }}", "width 999999999"),
        ("{{ '{:>999999999}'.format(1) }}", "width 999999999"),
        ("{{ '%0999999999d' | format(1) }}", "width 999999999"),
        ("{{ lipsum(10**6) }}", "lipsum"),
        ("{{ [1, 2] + range(100000) | list }}", None),  # fine: within the limits
        ("{{ '%05d' % 7 }}{{ '{:>4}'.format('a') }}{{ 'call 12345678' | upper }}", None),
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        ("{% for %}", "not valid Jinja"),
        # Plain Python errors in template code are the template's failure too.
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
    ],
)
def test_limits_give_a_clear_error(tokenizer: Any, template: str, needle: str | None) -> None:
    limits = SIZE_ONLY if template == NESTED_OUTPUT else FAST
    start = time.monotonic()
    if needle is None:
        assert render_chat_template(tokenizer, CHAT, chat_template=template, limits=limits)
        return
    with pytest.raises(ChatTemplateError, match=needle):
        render_chat_template(tokenizer, CHAT, chat_template=template, limits=limits)
    assert time.monotonic() - start < 30  # bounded: never the 10**10 steps the loops ask for


def test_limit_holds_in_a_worker_thread(tokenizer: Any) -> None:
    # The REPL and the TUI render from worker threads.
    errors: list[BaseException] = []

    def render() -> None:
        try:
            render_chat_template(tokenizer, CHAT, chat_template=NESTED_LOOP, limits=FAST)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and isinstance(errors[0], ChatTemplateError)
