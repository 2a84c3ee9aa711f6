"""The native kernels' own thread pool, thread counts taken from the cores a process may use,
and decode steps that keep torch's OpenMP workers out of the native workers' way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.native import NativeCpuOps
from tinyvllm.native.abi import FORMAT_Q4_1
from tinyvllm.native.build import library_path, load_library, unsupported_reason
from tinyvllm.native.quant_ops import QuantKernels
from tinyvllm.utils.cpu import (
    _cgroup_cpu_limit,
    available_cpus,
    native_threads,
    runnable_elsewhere,
)

native_only = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


@pytest.fixture(scope="module")
def lib():
    loaded = load_library()
    if loaded is None:
        pytest.skip("native kernels unavailable")
    return loaded


@native_only
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_library_links_no_openmp_runtime(lib) -> None:
    """A second OpenMP runtime next to torch's spins against it on a loaded machine."""
    dynamic = subprocess.run(
        ["readelf", "-d", str(library_path())], capture_output=True, text=True, check=True
    ).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed, dynamic
    assert not [line for line in needed if "omp" in line], needed


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_bits_do_not_depend_on_thread_count(lib, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(1000, 96, generator=gen).to(dtype)
    b = torch.randn(1000, generator=gen).to(dtype)
    for m in (1, 5, 8, 21):  # up to three tiles of 8 rows in one parallel region
        x = torch.randn(m, 96, generator=gen).to(dtype)
        ref = NativeCpuOps(lib, 1).linear(x, w, b)
        for threads in (2, 3, 8):  # 8: more threads than this machine may have cores
            assert torch.equal(NativeCpuOps(lib, threads).linear(x, w, b), ref), (m, threads)


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_gemv_and_dequant_bits_do_not_depend_on_thread_count(lib, dtype: torch.dtype) -> None:
    """bf16 activations take the vdpbf16ps Q4_1 kernel (K a whole number of block pairs)."""
    gen = torch.Generator().manual_seed(3)
    rows, k = 300, 64
    blocks = torch.randint(0, 256, (rows, k // 32, 20), generator=gen, dtype=torch.uint8)
    blocks[..., :4] = torch.tensor([0, 0x2C, 0, 0xA8], dtype=torch.uint8)  # fp16 d, m
    weight = blocks.reshape(rows, -1).contiguous()
    x = torch.randn(11, k, generator=gen).to(dtype)
    one, many = QuantKernels(lib, 1), QuantKernels(lib, 3)
    ref = one.gemv(x, FORMAT_Q4_1, weight, rows)
    assert torch.isfinite(ref).all()
    assert torch.equal(many.gemv(x, FORMAT_Q4_1, weight, rows), ref)
    deq = one.dequantize_rows(FORMAT_Q4_1, weight, k, 5, 290)
    assert torch.equal(many.dequantize_rows(FORMAT_Q4_1, weight, k, 5, 290), deq)


@native_only
def test_parallel_callers_share_the_pool(lib) -> None:
    """Engines in several threads of one process (LLM next to AsyncLLM) call concurrently."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(700, 128, generator=gen).to(torch.bfloat16)
    xs = [torch.randn(3, 128, generator=gen).to(torch.bfloat16) for _ in range(4)]
    refs = [NativeCpuOps(lib, 1).linear(x, w, None) for x in xs]
    ops = NativeCpuOps(lib, 2)
    failures: list[int] = []

    def worker(i: int) -> None:
        for _ in range(50):
            if not torch.equal(ops.linear(xs[i], w, None), refs[i]):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def test_cgroup_quota_caps_the_core_count(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert _cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    v1 = tmp_path / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpu_limit(tmp_path) == 3.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cgroup_cpu_limit(tmp_path) is None
    assert 1 <= available_cpus() <= len(__import__("os").sched_getaffinity(0))


def test_runnable_elsewhere_counts_other_processes_tasks(tmp_path: Path) -> None:
    """/proc/loadavg's running count less this process's runnable threads (a command name may
    hold ") R (" itself); None where /proc is missing."""
    loadavg, tasks = tmp_path / "loadavg", tmp_path / "task"
    loadavg.write_text("2.10 1.80 1.50 5/245 12345\n")
    for tid, stat in (("1", "1 (python) R 0 1"), ("2", "2 (a) R (b) S 1 2"), ("3", "3 (w) R 1")):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "stat").write_text(stat)
    assert runnable_elsewhere(loadavg, tasks) == 3  # 5 running, 2 of them ours (not tid 2)
    loadavg.write_text("0.1 0.1 0.1 1/245 12345\n")
    assert runnable_elsewhere(loadavg, tasks) == 0  # never below zero
    assert runnable_elsewhere(tmp_path / "missing", tasks) is None
    if Path("/proc/loadavg").exists():
        assert runnable_elsewhere() is not None


def test_native_threads_follow_torch_but_not_past_the_cores() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert native_threads() == 1
        torch.set_num_threads(available_cpus() + 3)
        assert native_threads() == available_cpus()
    finally:
        torch.set_num_threads(before)


@native_only
def test_native_decode_steps_keep_torch_single_threaded(tiny_models) -> None:
    """LLM.generate drives steps on the caller's thread, where torch's OpenMP team lives: its
    workers, woken by sampling, spun for milliseconds against the native workers (10x slower
    than AsyncLLM under load). Decode-program steps now run torch ops on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)
        runner = llm.engine.runner
        assert runner.decode_program is not None
        seen: list[tuple[int, int]] = []
        sampler = runner.sampler

        def recording_sampler(logits, metadata):
            seen.append((logits.shape[0], torch.get_num_threads()))
            return sampler(logits, metadata)

        runner.sampler = recording_sampler
        prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 70)]
        # Sampled, not greedy: plain greedy steps take their argmax without the sampler.
        params = SamplingParams(temperature=0.8, seed=0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # The 73-token first step is torch's (past the program's 16 fp32 rows): all its threads.
    assert seen[0] == (2, 2)
    assert seen[1:] and all(threads == 1 for _, threads in seen[1:]), seen


def _omp_policy_after_import(env: dict[str, str], code: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code + "; import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_import_leaves_the_openmp_wait_policy_to_the_user() -> None:
    """`import tinyvllm` sets no OpenMP wait policy (a passive one slowed torch code sharing
    the process, e.g. HF decode by ~40%); the user's own choice stands."""
    assert _omp_policy_after_import({}, "import tinyvllm") == "None"
    assert _omp_policy_after_import({"OMP_WAIT_POLICY": "PASSIVE"}, "import tinyvllm") == "PASSIVE"
