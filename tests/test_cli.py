"""The command line: generate and the HF parity check."""

from __future__ import annotations

import pytest

from tinyvllm.cli import main


def test_generate_prints_text(tiny_models, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_models["qwen2"]),
            "--max-tokens",
            "5",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "hello world",
        ]
    )
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
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy agreement 100.0%" in out


def test_bad_model_is_one_clear_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("tinyvllm: error:") and "Traceback" not in err
