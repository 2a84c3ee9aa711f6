"""Compile the CPU decode kernels once per machine and load them with ctypes.

The library has no torch headers, so it builds in a few seconds with the system C++
compiler; the result is cached by source hash and CPU flags. Without a compiler, on non-x86
CPUs or without AVX2/FMA the engine keeps its PyTorch path (`load_library` returns None).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Compiled together into one library: the decode kernels, the GGUF block GEMVs, the decode
# program that calls both and the thread pool they run on; common.h holds what they share.
SOURCES = (
    Path(__file__).with_name("cpu_kernels.cpp"),
    Path(__file__).with_name("quant_kernels.cpp"),
    Path(__file__).with_name("llama_decode.cpp"),
    Path(__file__).with_name("thread_pool.cpp"),
)
HEADERS = (Path(__file__).with_name("common.h"),)
# No fp contraction: element-wise steps must round exactly like the eager ops they replace.
# No OpenMP: thread_pool.cpp is the library's own runtime (a second OpenMP next to torch's
# spins against it under load).
FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-shared", "-fPIC",
    "-std=c++17",
)  # fmt: skip
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cache_dir() -> Path:
    override = os.environ.get("TINYVLLM_CACHE_DIR")
    if override:
        return Path(override) / "native"
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # the GPU image has no platformdirs
        return Path.home() / ".cache" / "tinyvllm" / "native"
    return Path(user_cache_dir("tinyvllm")) / "native"


def unsupported_reason() -> str | None:
    """Why the native kernels cannot run here (None when they can)."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"CPU architecture {platform.machine()} (the kernels are x86 AVX2)"
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        return f"CPU lacks {sorted(missing)}"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (install g++ or set CXX)"
    return None


def library_path() -> Path:
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    key = digest.hexdigest()[:16]
    return cache_dir() / f"tinyvllm_cpu_{key}.so"


def build(target: Path) -> None:
    """Compile into a temporary file, then rename, so concurrent processes never load half a
    library. The sources compile in parallel (each takes seconds at -O3), then link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    compile_flags = [flag for flag in FLAGS if flag != "-shared"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmpdir:
        objects = [str(Path(tmpdir) / f"{source.stem}.o") for source in SOURCES]
        procs = [
            subprocess.Popen(
                [cxx, *compile_flags, "-c", "-o", obj, str(source)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            for source, obj in zip(SOURCES, objects, strict=True)
        ]  # fmt: skip
        results = [(proc.communicate()[1], proc.returncode) for proc in procs]
        library = str(Path(tmpdir) / "library.so")
        if all(code == 0 for _, code in results):
            link = subprocess.run(
                [cxx, *FLAGS, "-o", library, *objects], capture_output=True, text=True
            )
            results = [(link.stderr, link.returncode)]
        failed = [err.strip() or f"{cxx} exited with {code}" for err, code in results if code]
        if failed:
            names = " + ".join(source.name for source in SOURCES)
            message = "\n".join(failed)[-2000:]
            raise RuntimeError(f"building {names} failed: {message}")
        os.replace(library, target)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when unsupported here."""
    reason = unsupported_reason()
    if reason is not None:
        logger.info("native CPU kernels off: %s", reason)
        return None
    path = library_path()
    try:
        if not path.exists():
            build(path)
        return ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as exc:
        logger.warning("native CPU kernels off: %s", exc)
        return None
