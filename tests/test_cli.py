"""The command line: generate and the HF parity check."""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

import pytest

from tinyvllm.cli import build_parser, main
from tinyvllm.runner.model_runner import ModelRunner


def tiny_generate(model: Path, *extra: str) -> list[str]:
    return [
        "generate",
        "--model",
        str(model),
        "--max-tokens",
        "5",
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        *extra,
    ]


def test_generate_prints_text(tiny_models, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(tiny_generate(tiny_models["qwen2"], "hello world"))
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tok/s" in captured.err


def test_check_reports_parity(tiny_models, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "check",
            "--model",
            str(tiny_models["qwen2"]),
            "--max-tokens",
            "8",
            "--max-model-len",
            "128",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "greedy agreement 100.0%" in captured.out
    # One line of its own instead of transformers' progress bars.
    err = captured.err[captured.err.index("loading the transformers reference") :]
    assert re.fullmatch(
        r"loading the transformers reference for \S+ \.\.\. done in [\d.]+ s\n", err
    )


def test_bad_model_is_one_clear_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("tinyvllm: error:") and "Traceback" not in err


@pytest.mark.parametrize(
    ("command", "flag", "field"),
    [
        ("generate", ["--max-tokens", "0"], "max_tokens"),
        ("generate", ["--temperature", "-1"], "temperature"),
        ("generate", ["--top-p", "2"], "top_p"),
        ("generate", ["--top-k", "-5"], "top_k"),
        ("check", ["--max-tokens", "0"], "max_tokens"),
        ("chat", ["--top-p", "0"], "top_p"),
    ],
)
def test_bad_sampling_flags_fail_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, flag: list[str], field: str
) -> None:
    # The model does not exist: an error about it would mean the load was tried first.
    prompt = [] if command == "chat" else ["hi"]
    rc = main([command, "--model", str(tmp_path / "nope.gguf"), *flag, *prompt])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tinyvllm: error:") and field in err, err
    assert "nope" not in err


def test_a_failed_request_is_reported_and_exits_nonzero(
    tiny_models, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: ModelRunner, sched: object) -> None:
        raise RuntimeError("injected kernel fault")

    monkeypatch.setattr(ModelRunner, "execute_model", broken)
    rc = main(tiny_generate(tiny_models["qwen2"], "hello world"))
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    assert (
        "tinyvllm: error: prompt 0 failed: model step failed: RuntimeError: injected kernel "
        "fault" in captured.err
    )


def test_undecodable_stdin_and_unencodable_prompts(
    tiny_models, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A POSIX locale hands undecodable bytes on as lone surrogates.
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff"), errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(tiny_generate(tiny_models["qwen2"])) == 0
    assert capsys.readouterr().out.strip()
    # argv decoded with surrogateescape: a clear sentence before any load, no tokenizer
    # traceback (with --chat the template's text went to the tokenizer unchecked).
    for chat in ([], ["--chat"]):
        rc = main(["generate", "--model", "nope.gguf", *chat, "fine", "caf\udce9"])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("tinyvllm: error: prompt 1 is not valid Unicode"), err


def test_tui_module_and_tui_command_take_the_same_arguments() -> None:
    from tinyvllm_tui.cli import build_parser as build_tui_parser

    def options(parser: argparse.ArgumentParser) -> list[tuple[object, ...]]:
        return [(a.option_strings, a.default, a.type, a.help) for a in parser._actions]

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert options(sub.choices["tui"]) == options(build_tui_parser())
