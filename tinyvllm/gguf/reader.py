"""Reading a .gguf file: header, metadata and tensor directory, tensor bytes memory-mapped.

The format is plain data (a header, typed key/value pairs, a tensor directory, then
aligned tensor bytes), so nothing in the file is ever executed. We parse it ourselves
rather than with `gguf.GGUFReader`, which builds a numpy view per string and takes
seconds on a real tokenizer's vocabulary; the `gguf` package remains the reference the
tests compare this parser with.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinyvllm.gguf.dequant import block_layout, qtype_name
from tinyvllm.gguf.metadata import MIN_KV_BYTES, GGUFMetadata, MetadataCursor

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, ndims, type, offset
# ggml tensors have at most four dimensions.
_MAX_DIMS = 4
# ggml type ids of the unquantized formats: F32, F16, BF16.
_FLOAT_QTYPES = frozenset({0, 1, 30})


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory. `shape` is in torch order (outermost first),
    the reverse of ggml's `ne`; `offset` is absolute within the file."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def qtype_name(self) -> str:
        return qtype_name(self.qtype)


@dataclass
class GGUFFile:
    """A parsed .gguf file. Tensor bytes stay on disk until `raw` maps them."""

    path: Path
    version: int
    metadata: Mapping[str, Any]
    tensors: dict[str, TensorInfo]
    _map: mmap.mmap | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path} has no general.architecture metadata")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def has_quantized_tensors(self) -> bool:
        """Whether any matrix is stored in a block-quantized format (not F32/F16/BF16)."""
        return any(
            len(t.shape) >= 2 and t.qtype not in _FLOAT_QTYPES for t in self.tensors.values()
        )

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor mapped from the file: [rows, bytes_per_row]
        for 2-D and larger tensors, [bytes] for 1-D ones. No copy is made."""
        info = self.tensors[name]
        if self._map is None:
            # Copy-on-write: torch gets writable views without a copy (a read-only map
            # makes it warn), pages stay shared with the page cache, the file never changes.
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        array = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return torch.from_numpy(array).view(self.raw_shape(name))

    def read(self, name: str) -> torch.Tensor:
        """The tensor's bytes copied into memory of its own, shaped as `raw` shapes them.

        Read from the file (its page cache) straight into the new tensor, so the load never
        holds the file's pages and a copy of them at once, which a mapped view plus a copy
        does (the 262k x 640 embedding of Gemma 3 270M: 178 MiB twice at the load's peak)."""
        info = self.tensors[name]
        shape = self.raw_shape(name)
        tensor = torch.empty(shape, dtype=torch.uint8)
        view = memoryview(tensor.numpy()).cast("B")
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(info.offset)
            done = 0
            while done < info.nbytes:
                count = handle.readinto(view[done:])
                if not count:
                    raise ValueError(
                        f"{str(self.path)!r} is truncated: tensor {name!r} ends at byte "
                        f"{info.offset + info.nbytes}, read stopped at {info.offset + done}"
                    )
                done += count
        return tensor

    def raw_shape(self, name: str) -> tuple[int, ...]:
        """[rows, bytes_per_row] for 2-D and larger tensors, [bytes] for 1-D ones."""
        info = self.tensors[name]
        if len(info.shape) < 2:
            return (info.nbytes,)
        rows = 1
        for dim in info.shape[:-1]:
            rows *= dim
        return (rows, info.nbytes // rows if rows else 0)

    def release(self, name: str) -> None:
        """Drop the tensor's file pages from this process's memory once its values were copied
        out. Without this a load holds the whole file's pages (counted in RSS) next to the
        weights built from them, ~2x the model at peak. A view still in use stays valid: the
        mapping is private and never written, so its pages are read back from the file."""
        info = self.tensors[name]
        advice = getattr(mmap, "MADV_DONTNEED", None)  # absent on Windows: keep the pages
        if self._map is None or info.nbytes <= 0 or advice is None:
            return
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.nbytes) // page * page
        if end > start:
            self._map.madvise(advice, start, end - start)


def is_gguf_file(path: str | Path) -> bool:
    """True when `path` is a regular file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header, metadata and tensor directory of a .gguf file.

    Raises FileNotFoundError for a missing file and ValueError for a file that is not
    GGUF (bad magic), a GGUF version we cannot read, or a truncated/corrupt file.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {str(path)!r}")
    st = path.stat()
    return _read_unchanged(path, st.st_ino, st.st_size, st.st_mtime_ns)


# One load reads the file's header from several places (config, quantization, tokenizer, the
# loader's checks, the weights); they share one parse while the file stays the same file
# (inode, size and modification time: a rewritten file is parsed again).
@functools.lru_cache(maxsize=4)
def _read_unchanged(path: Path, inode: int, size: int, mtime_ns: int) -> GGUFFile:
    with open(path, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ValueError(
                f"{str(path)!r} is not a GGUF file (it does not start with the 'GGUF' magic)"
            )
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buffer, path)
    except (ArithmeticError, RecursionError, UnicodeError, struct.error) as exc:
        raise ValueError(f"{str(path)!r} is corrupt ({type(exc).__name__}: {exc})") from None
    finally:
        buffer.close()


def _parse(buffer: mmap.mmap, path: Path) -> GGUFFile:
    cur = MetadataCursor(buffer, path)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ValueError(f"{str(path)!r} has GGUF version {version}{hint}; versions 2 and 3 load")
    tensor_count = cur.scalar("<Q")
    kv_count = cur.count("metadata entries", MIN_KV_BYTES)
    values: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        values[key] = cur.value(cur.scalar("<I"))
    metadata = GGUFMetadata(values, path)
    if tensor_count * _MIN_TENSOR_INFO_BYTES > len(buffer) - cur.pos:
        raise ValueError(
            f"{str(path)!r} is truncated or corrupt: it declares {tensor_count} tensors, more "
            "than the rest of the file can describe"
        )
    directory: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cur.string()
        ndims = cur.scalar("<I")
        if ndims > _MAX_DIMS:
            raise ValueError(
                f"{str(path)!r}: tensor {name!r} has {ndims} dimensions (at most {_MAX_DIMS})"
            )
        ne = [cur.scalar("<Q") for _ in range(ndims)]
        directory.append((name, tuple(reversed(ne)), cur.scalar("<I"), cur.scalar("<Q")))
    alignment = _alignment(metadata, path)
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, qtype, rel_offset in directory:
        nbytes = _nbytes(shape, qtype, name, path)
        info = TensorInfo(name, qtype, shape, data_start + rel_offset, nbytes)
        tensors[name] = info
        end = info.offset + info.nbytes
        if info.nbytes >= 0 and end > len(buffer):
            raise ValueError(
                f"{str(path)!r} is truncated: tensor {name!r} ends at byte {end}, "
                f"the file has {len(buffer)}"
            )
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)


def _alignment(metadata: Mapping[str, Any], path: Path) -> int:
    value = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(
            f"{str(path)!r}: metadata general.alignment must be a power of two, got {value!r}"
        )
    return value


def _nbytes(shape: tuple[int, ...], qtype: int, name: str, path: Path) -> int:
    """Bytes of a tensor; -1 for types we cannot size (they fail when loaded, by name)."""
    try:
        elems, block_bytes = block_layout(qtype)
    except ValueError:
        return -1
    count = 1
    for dim in shape:
        count *= dim
    if shape and shape[-1] % elems:
        raise ValueError(
            f"{str(path)!r}: tensor {name!r} rows of {shape[-1]} are not whole "
            f"{qtype_name(qtype)} blocks of {elems}"
        )
    return count // elems * block_bytes
