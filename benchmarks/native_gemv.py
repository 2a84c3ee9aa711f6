"""The native GGUF GEMVs with no Python in the loop: builds benchmarks/native_gemv.cpp against
the kernel sources (tinyvllm/native/build.py's, same flags) and runs it. Per SmolLM2-135M
shape, single-stream: microseconds per GEMV hot (one weight copy, in L2) and cold (a copy per
layer), and per token (30 layers' four Q4_1 GEMVs, then the Q8_0 lm_head: 96 MB of weights).

    python benchmarks/native_gemv.py [--int8-activations] [--reps 200] [--mode 0|1|2]

--mode 1: the token at 2 threads only (quick A/B runs), 2: hot GEMVs at 1 thread only (the
kernels' instruction cost; thread CPU time, so a busy box changes it little).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from tinyvllm.native.build import FLAGS, SOURCES

HARNESS = Path(__file__).with_name("native_gemv.cpp")


def build(folder: Path) -> Path:
    """Objects compile in parallel; the harness links them into one executable."""
    cxx = os.environ.get("CXX", "g++")
    flags = [flag for flag in FLAGS if flag not in ("-shared", "-fPIC")]
    procs = []
    objects = []
    for source in (*SOURCES, HARNESS):
        obj = folder / f"{source.stem}.o"
        objects.append(str(obj))
        procs.append(subprocess.Popen([cxx, *flags, "-c", "-o", str(obj), str(source)]))
    if any(proc.wait() for proc in procs):
        raise SystemExit("building the harness failed (compiler errors above)")
    exe = folder / "native_gemv"
    subprocess.run([cxx, "-pthread", "-o", str(exe), *objects], check=True)
    return exe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--int8-activations", action="store_true")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--mode", type=int, default=0, choices=[0, 1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
        flags = "256" if args.int8_activations else "0"
        subprocess.run([str(exe), flags, str(args.reps), str(args.mode)], check=True)
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
