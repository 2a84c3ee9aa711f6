"""`tinyvllm serve` as a command: flag errors before any model load, the hint when the serve
extra is missing, and the real program serving a tiny checkpoint to the openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tinyvllm.cli import build_parser, main
from tinyvllm.server.cli import API_KEY_ENV, api_key, serve_engine_kwargs

ROOT = Path(__file__).resolve().parent.parent
NO_SUCH_MODEL = "/nonexistent/model/dir"


def test_missing_extra_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now fails
    assert main(["serve", NO_SUCH_MODEL]) == 2
    err = capsys.readouterr().err
    assert "pip install 'tinyvllm[serve]'" in err and "fastapi" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
        (["--speculative-config", "[1]"], "must be a JSON object"),
        (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
        (["--model", "other"], "two models given"),
        (["--video-pruning-rate", "1.5"], "--video-pruning-rate: video_pruning_rate must be"),
        (["--video-pruning-rate", "-0.1"], "in [0, 1)"),
        (["--video-pruning-rate", "nan"], "got nan"),
        (["--max-num-seqs", "0"], "--max-num-seqs: max_num_seqs must be at least 1"),
    ],
)
def test_bad_flags_fail_before_loading(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", NO_SUCH_MODEL, *flags]) == 2
    assert message in capsys.readouterr().err


def test_flags_become_engine_arguments() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "8",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
        ]
    )
    assert args.host == "127.0.0.1" and args.port == 8000
    assert serve_engine_kwargs(args) == {
        "enable_prefix_caching": False,
        "max_num_seqs": 8,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
    }
    defaults = build_parser().parse_args(["serve"])
    assert serve_engine_kwargs(defaults) == {}  # the engine's (and catalog's) defaults stand


def test_bad_runner_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", NO_SUCH_MODEL, "--runner", "embed"])
    assert exit_info.value.code == 2
    assert "--runner: invalid choice: 'embed'" in capsys.readouterr().err


def test_runner_and_video_pruning_rate_reach_the_engine(tiny_models: Any) -> None:
    """`serve`'s setup (flag parsing, checks, model resolution) hands both to the engine."""
    from tinyvllm.cli import serve_setup

    path = str(tiny_models["llama"])
    args = build_parser().parse_args(
        ["serve", path, "--runner", "pooling", "--video-pruning-rate", "0.25"]
    )
    model, kwargs, _ = serve_setup(args)
    assert model == path
    assert kwargs["runner"] == "pooling" and kwargs["video_pruning_rate"] == 0.25
    _, auto, _ = serve_setup(build_parser().parse_args(["serve", path]))
    assert "runner" not in auto and "video_pruning_rate" not in auto  # the engine's defaults


def test_api_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(parse(["serve"])) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(parse(["serve"])) == "from-env"
    assert api_key(parse(["serve", "--api-key", "from-flag"])) == "from-flag"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tinyvllm serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("tinyvllm serve did not become healthy")


@pytest.mark.slow
def test_the_serve_command(tiny_models: Any) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    port = _free_port()
    env = {**os.environ, API_KEY_ENV: "k3y", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tinyvllm.cli", "serve", str(tiny_models["llama"])]
    cmd += ["--port", str(port), "--served-model-name", "tiny", "--dtype", "float32"]
    cmd += ["--max-model-len", "128", "--device", "cpu", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert out.usage.completion_tokens <= 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"serving tiny at http://127.0.0.1:{port}/v1" in err
