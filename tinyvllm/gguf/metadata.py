"""GGUF metadata: typed key/value pairs read with bounds checks, long string arrays lazily.

Every count read from the file is checked against the bytes left before anything is built
from it, and arrays nest at most a few levels: an untrusted file cannot drive unbounded
memory or time. A tokenizer's vocabulary and merges (~10^5 strings) are only walked while
parsing and decoded on first read, so start-up reads just the model's sizes.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Metadata value type id -> struct format of one scalar (8 = string, 9 = array).
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# Fewest bytes one item of each kind takes in the file: counts read from the file are
# checked against the bytes left before anything is built from them.
_MIN_ITEM_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
# Metadata arrays nest a level or two in real files.
_MAX_NESTING = 8
# String arrays longer than this (a tokenizer's vocabulary and merges: ~100k strings) are
# only walked, for the bounds checks, while parsing; their strings are decoded on first read.
_LAZY_ARRAY_ITEMS = 64


@dataclass(frozen=True)
class _LazyArray:
    """A metadata array of strings (or arrays) kept as its bytes, already bounds-checked."""

    data: bytes
    item_type: int
    count: int

    def decode(self, path: Path) -> list[Any]:
        cur = MetadataCursor(self.data, path, lazy=False)
        if self.item_type == _STRING:
            return cur.strings(self.count)
        return [cur.value(self.item_type, 1) for _ in range(self.count)]


class GGUFMetadata(Mapping[str, Any]):
    """The metadata key/value pairs. Long string arrays (the tokenizer's vocabulary and
    merges) are decoded on first access: start-up reads only the model's sizes."""

    def __init__(self, values: dict[str, Any], path: Path) -> None:
        self._values = values
        self._path = path

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if isinstance(value, _LazyArray):
            value = self._values[key] = value.decode(self._path)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"GGUFMetadata({len(self)} keys of {self._path.name!r})"


class MetadataCursor:
    """Sequential little-endian reads over the file's bytes."""

    def __init__(self, buffer: mmap.mmap | bytes, path: Path, lazy: bool = True) -> None:
        self.buffer = buffer
        self.pos = 0
        self.path = path
        self.lazy = lazy

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        except struct.error:
            raise ValueError(f"{self.path} is truncated or corrupt (read past its end)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise ValueError(f"{self.path} is truncated or corrupt (string past its end)")
        raw = self.buffer[self.pos : end]
        self.pos = end
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop: a vocabulary holds 262k of them (Gemma 3), and
        going through `string` for each took most of a second per parse."""
        buffer, pos, size = self.buffer, self.pos, len(self.buffer)
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError(f"{self.path} is truncated or corrupt (read past its end)")
            (length,) = unpack(buffer, pos)
            start, pos = pos + 8, pos + 8 + length
            if pos > size:
                raise ValueError(f"{self.path} is truncated or corrupt (string past its end)")
            append(buffer[start:pos].decode("utf-8", errors="replace"))
        self.pos = pos
        return out

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count read from the file, checked against the bytes that are left."""
        count = self.scalar("<Q")
        left = len(self.buffer) - self.pos
        if count * min_item_bytes > left:
            raise ValueError(
                f"{self.path} is truncated or corrupt: it declares {count} {what}, more than "
                f"its remaining {left} bytes can hold"
            )
        return count

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= _MAX_NESTING:
                raise ValueError(f"{self.path} nests metadata arrays over {_MAX_NESTING} deep")
            item_type = self.scalar("<I")
            if item_type not in _MIN_ITEM_BYTES:
                raise ValueError(
                    f"{self.path} has an unknown metadata array item type {item_type} (corrupt?)"
                )
            count = self.count("array items", _MIN_ITEM_BYTES[item_type])
            if self.lazy and count > _LAZY_ARRAY_ITEMS and item_type in (_STRING, _ARRAY):
                return self.lazy_array(item_type, count, depth)
            if item_type == _STRING:
                return self.strings(count)
            if item_type in _NUMPY:
                # Numeric arrays (token types, scores) are read in one go.
                dtype = np.dtype(_NUMPY[item_type])
                values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
                self.pos += dtype.itemsize * count
                return values.tolist()
            return [self.value(item_type, depth + 1) for _ in range(count)]
        raise ValueError(f"{self.path} has an unknown metadata value type {vtype} (corrupt?)")

    def lazy_array(self, item_type: int, count: int, depth: int) -> _LazyArray:
        """A long array of strings (or arrays) walked for its bounds, kept as its bytes."""
        start = self.pos
        if item_type == _STRING:
            self.skip_strings(count)
        else:
            for _ in range(count):
                self.value(item_type, depth + 1)
        return _LazyArray(self.buffer[start : self.pos], item_type, count)

    def skip_strings(self, count: int) -> None:
        """Move past `count` strings, checking each stays inside the file (a tight loop: a
        vocabulary has ~10^5 of them)."""
        buffer, pos, end = self.buffer, self.pos, len(self.buffer)
        unpack = _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            pos += 8 + unpack(buffer, pos)[0]
        else:
            if pos <= end:
                self.pos = pos
                return
        raise ValueError(f"{self.path} is truncated or corrupt (string past its end)")
