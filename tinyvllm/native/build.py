"""Compile the CPU decode kernels once per machine and load them with ctypes.

The library has no torch headers, so it builds in a few seconds with the system C++
compiler; the result is cached by source hash and CPU flags. Without a compiler, on non-x86
CPUs or without AVX2/FMA the engine keeps its PyTorch path (`load_library` returns None).

Loading a library runs its constructors, so only a cache the user alone can write is
trusted: the folder is created 0700, and a folder or library that belongs to someone else or
is group/world-writable is ignored (the kernels then build in a private temporary folder).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from tinyvllm.native import abi
from tinyvllm.utils.cpu import cpu_flags
from tinyvllm.utils.dirs import native_cache_dir

logger = logging.getLogger(__name__)

# Compiled together into one library: the decode kernels, the GGUF block GEMVs, the decode
# program that calls both and the thread pool they run on; common.h holds what they share.
SOURCES = (
    Path(__file__).with_name("cpu_kernels.cpp"),
    Path(__file__).with_name("row_kernels.cpp"),
    Path(__file__).with_name("quant_kernels.cpp"),
    Path(__file__).with_name("llama_decode.cpp"),
    Path(__file__).with_name("thread_pool.cpp"),
    Path(__file__).with_name("avx512_kernels.cpp"),
    Path(__file__).with_name("gemv_avx512f.cpp"),
    Path(__file__).with_name("bf16_pairs.cpp"),
    Path(__file__).with_name("bf16_pairs_avx512f.cpp"),
    Path(__file__).with_name("int8_kernels.cpp"),
    Path(__file__).with_name("rows16_layout.cpp"),
    Path(__file__).with_name("int8_rows16.cpp"),
    Path(__file__).with_name("int8_rows16_avx2.cpp"),
    Path(__file__).with_name("bf16_rows16.cpp"),
    Path(__file__).with_name("bf16_rows16_avx2.cpp"),
    Path(__file__).with_name("bf16_rows16_avx512f.cpp"),
    Path(__file__).with_name("attn_avx512.cpp"),
    Path(__file__).with_name("attn_amx.cpp"),
    Path(__file__).with_name("prefill_attn_amx.cpp"),
    Path(__file__).with_name("prefill_attn_avx2.cpp"),
    Path(__file__).with_name("prefill_attn_avx512f.cpp"),
    Path(__file__).with_name("amx_linear.cpp"),
)
HEADERS = (
    Path(__file__).with_name("common.h"),
    Path(__file__).with_name("avx512_math.h"),
    Path(__file__).with_name("amx_tiles.h"),
    Path(__file__).with_name("attn_value.h"),
    Path(__file__).with_name("paged_decode.h"),
    Path(__file__).with_name("omp_team.h"),
    Path(__file__).with_name("int8_act.h"),
    Path(__file__).with_name("rows16_kernels.h"),
    Path(__file__).with_name("bf16_rows16_exact.h"),
    Path(__file__).with_name("bf16_pairs_tile.h"),
    Path(__file__).with_name("prefill_attn_f32.h"),
)
# No fp contraction: element-wise steps must round exactly like the eager ops they replace.
# No OpenMP: thread_pool.cpp is the library's own runtime (a second OpenMP next to torch's
# spins against it under load).
FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-shared", "-fPIC",
    "-std=c++17",
)  # fmt: skip
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
# An exported function: `void tv_name(` or `int64_t tv_name(` (any return type, optionally
# `extern "C"`) at the start of a line of a source file.
_EXPORT = re.compile(r'^(?:extern "C" )?\w+ (tv_\w+)\(', re.MULTILINE)


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
    return native_cache_dir() / f"tinyvllm_cpu_{key}.so"


def build(target: Path) -> None:
    """Compile into a temporary file, then rename, so concurrent processes never load half a
    library. The sources compile in parallel (each takes seconds at -O3), then link."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
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


def exported_symbols() -> list[str]:
    """The functions the sources export (abi.FUNCTIONS declares the same, tested)."""
    return sorted({name for src in SOURCES for name in _EXPORT.findall(src.read_text())})


def untrusted_reason(path: Path, is_dir: bool) -> str | None:
    """Why `path` may have been written by someone else (None when only the user can have)."""
    info = path.lstat()
    kind = "folder" if is_dir else "library"
    expected = stat.S_ISDIR(info.st_mode) if is_dir else stat.S_ISREG(info.st_mode)
    if not expected:
        return f"the cached {kind} {path} is not a plain {kind}"
    if info.st_uid != os.getuid():
        return f"the cached {kind} {path} belongs to user id {info.st_uid}, not to you"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"the cached {kind} {path} is writable by others (mode {info.st_mode & 0o777:o})"
    return None


def _trusted_cache(path: Path) -> bool:
    """Create the cache folder 0700 if needed; False (with a warning) when the folder or the
    library in it is not the user's alone."""
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)  # mkdir's mode is filtered by the umask
    reason = untrusted_reason(folder, is_dir=True)
    if reason is None and (path.exists() or path.is_symlink()):
        reason = untrusted_reason(path, is_dir=False)
    if reason is not None:
        logger.warning("native CPU kernels: not loading the cache (%s); building privately", reason)
    return reason is None


def _open_checked(path: Path) -> ctypes.CDLL | None:
    """The library at `path` with every function bound to its `abi` signature, or None (one
    log line) when it does not load, lacks a function the Python side calls or was built for
    another ABI version (a stale or foreign library)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("native CPU kernels off: %s does not load (%s)", path, exc)
        return None
    missing = abi.missing_functions(lib)
    if missing:
        logger.warning(
            "native CPU kernels off: %s lacks %s (delete it to rebuild)", path, ", ".join(missing)
        )
        return None
    abi.bind(lib)
    return lib


def abi_mismatch(lib: ctypes.CDLL) -> str | None:
    """Why `lib` cannot be called through `abi` (None when its version is abi.ABI_VERSION)."""
    version = lib.tv_abi_version()
    if version == abi.ABI_VERSION:
        return None
    return f"it was built for native ABI version {version}, this tinyvllm needs {abi.ABI_VERSION}"


def _open_current(path: Path, rebuild: bool) -> ctypes.CDLL | None:
    """`_open_checked`, and on an ABI version mismatch one rebuild (when `rebuild`) before
    giving up with one log line."""
    lib = _open_checked(path)
    reason = None if lib is None else abi_mismatch(lib)
    if reason is not None and rebuild:
        logger.info("native CPU kernels: rebuilding %s (%s)", path, reason)
        # dlopen hands back the already mapped library for a path it has opened: build and
        # open the new one under another name, then move it into the cache.
        fresh = path.with_name(f"{path.stem}.rebuilt{path.suffix}")
        build(fresh)
        lib = _open_current(fresh, rebuild=False)
        os.replace(fresh, path)
        return lib
    if reason is not None:
        logger.warning("native CPU kernels off: %s: %s", path, reason)
        return None
    return lib


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when unsupported here."""
    reason = unsupported_reason()
    if reason is not None:
        logger.info("native CPU kernels off: %s", reason)
        return None
    path = library_path()
    try:
        if _trusted_cache(path):
            if not path.exists():
                build(path)
            return _open_current(path, rebuild=True)
        # mkdtemp folders are 0700 and new; the mapped library outlives its file.
        with tempfile.TemporaryDirectory(prefix="tinyvllm-native-") as private:
            own = Path(private) / path.name
            build(own)
            return _open_current(own, rebuild=False)
    except (OSError, RuntimeError) as exc:
        logger.warning("native CPU kernels off: %s", exc)
        return None
