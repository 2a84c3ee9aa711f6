"""Leaving the interpreter with AsyncLLM requests in flight keeps the program's own traceback
and exit status: the engine thread is stopped at exit instead of being killed inside torch,
which aborted the process (SIGABRT, exit 134, "terminate called without an active
exception")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys

from tinyvllm import SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM

llm = AsyncLLM(sys.argv[1], dtype="float32", max_model_len=512)
params = SamplingParams(max_tokens=500, ignore_eos=True)
# Module globals: the streams stay open, so their requests are still running at exit.
streams = [llm.stream({"prompt_token_ids": [10 + i] * 20}, params) for i in range(4)]
for _, out in zip(range(3), streams[0]):
    pass
print("streaming", flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("a bug in the user's program")
if sys.argv[2] == "exit":
    sys.exit(3)
"""

# mode -> the exit status the program itself asks for
MODES = {"raise": 1, "exit": 3, "end": 0}


def run_exits(model: Path, tmp_path: Path, modes: list[str]) -> None:
    """Run the script once per entry of `modes`, all at once."""
    script = tmp_path / "in_flight_at_exit.py"
    script.write_text(SCRIPT)
    runs = [
        (mode, subprocess.Popen(
            [sys.executable, str(script), str(model), mode],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
        for mode in modes
    ]  # fmt: skip
    for mode, proc in runs:
        out, err = proc.communicate(timeout=300)
        assert "streaming" in out, err
        assert proc.returncode == MODES[mode], (mode, proc.returncode, err[-2000:])
        assert "terminate called" not in err, (mode, err[-2000:])
        if mode == "raise":
            assert "RuntimeError: a bug in the user's program" in err


def test_exit_after_an_exception_with_requests_in_flight(tiny_models, tmp_path: Path) -> None:
    # Before the fix this aborted 3 runs out of 3.
    run_exits(tiny_models["llama"], tmp_path, ["raise"])


@pytest.mark.slow
def test_every_exit_with_requests_in_flight_repeatedly(tiny_models, tmp_path: Path) -> None:
    run_exits(tiny_models["llama"], tmp_path, [mode for _ in range(4) for mode in MODES])
