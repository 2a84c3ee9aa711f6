"""Compile the CPU decode kernels once per machine and load them with ctypes.

The library has no torch headers, so it builds in about a second with the system C++
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

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# No fp contraction: element-wise steps must round exactly like the eager ops they replace.
FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
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
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"tinyvllm_cpu_{key}.so"


def build(target: Path) -> None:
    """Compile into a temporary file, then rename, so concurrent processes never load half a
    library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [os.environ.get("CXX", "g++"), *FLAGS, "-o", tmp, str(SOURCE)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        os.unlink(tmp)
        raise RuntimeError(f"building {SOURCE.name} failed: {exc.stderr.strip()[-2000:]}") from exc


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
