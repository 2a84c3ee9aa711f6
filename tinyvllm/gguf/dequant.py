"""GGML block formats -> float32 torch tensors, vectorised over all blocks at once.

Every format stores each row as consecutive fixed-size blocks; a block holds `block_elems`
weights as small integers plus fp16 scale (and min) fields. The layouts follow ggml's
`block_*` structs (ggml-common.h) and the `gguf` package's numpy reference, and the float
arithmetic is done in the same order so results match that reference bit for bit.

`q4_blocks` / `q8_blocks` expose the per-32-element integer values and scales of the
4-bit and 8-bit formats, for kernels that repack them instead of dequantizing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

QK_K = 256  # elements per super-block of the k-quants

# ggml type id -> (name, elements per block, bytes per block). Ids are fixed by the format.
_FORMATS: Mapping[int, tuple[str, int, int]] = MappingProxyType(
    {
        0: ("F32", 1, 4),
        1: ("F16", 1, 2),
        2: ("Q4_0", 32, 2 + 16),
        3: ("Q4_1", 32, 2 + 2 + 16),
        6: ("Q5_0", 32, 2 + 4 + 16),
        7: ("Q5_1", 32, 2 + 2 + 4 + 16),
        8: ("Q8_0", 32, 2 + 32),
        10: ("Q2_K", QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
        11: ("Q3_K", QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
        12: ("Q4_K", QK_K, 2 + 2 + 12 + QK_K // 2),
        13: ("Q5_K", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
        14: ("Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
        30: ("BF16", 1, 2),
    }
)

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K = 2, 3, 6, 8, 12
# Formats whose every value w = d * q is exactly a Q8_0 value with the same d (`to_q8_0`).
Q8_0_SUBSETS = frozenset({Q4_0, Q5_0, Q8_0})


def qtype_name(qtype: int) -> str:
    """The ggml name of a type id, also for types we cannot decode."""
    if qtype in _FORMATS:
        return _FORMATS[qtype][0]
    try:
        import gguf

        return gguf.GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return f"type {qtype}"


def supported_qtypes() -> list[str]:
    return [name for name, _, _ in _FORMATS.values()]


def is_supported(qtype: int) -> bool:
    return qtype in _FORMATS


def block_layout(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block); ValueError naming an unsupported type."""
    if qtype not in _FORMATS:
        raise ValueError(
            f"GGUF tensor type {qtype_name(qtype)} is not supported; supported types: "
            f"{', '.join(supported_qtypes())}"
        )
    _, elems, nbytes = _FORMATS[qtype]
    return elems, nbytes


def row_bytes(qtype: int, cols: int) -> int:
    elems, nbytes = block_layout(qtype)
    if cols % elems:
        raise ValueError(
            f"a {qtype_name(qtype)} row of {cols} elements is not a whole number of "
            f"{elems}-element blocks"
        )
    return cols // elems * nbytes


def _blocks(data: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The raw bytes as [num_blocks, bytes_per_block] uint8, after checking the size."""
    rows = 1
    for dim in shape[:-1]:
        rows *= dim
    expected = rows * row_bytes(qtype, shape[-1])
    if data.dtype != torch.uint8:
        raise ValueError(f"GGUF block data must be uint8 bytes, got {data.dtype}")
    if data.numel() != expected:
        raise ValueError(
            f"{qtype_name(qtype)} tensor of shape {tuple(shape)} needs {expected} bytes, "
            f"got {data.numel()}"
        )
    return data.reshape(-1, block_layout(qtype)[1])


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as float32 [num_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifted(packed: torch.Tensor, shifts: list[int], groups: int) -> torch.Tensor:
    """Split `packed` [n, B] into `groups` runs and shift each run by every amount in
    `shifts`: [n, groups, len(shifts), B / groups], the order ggml stores sub-fields in."""
    n = packed.shape[0]
    amounts = torch.tensor(shifts, dtype=torch.uint8, device=packed.device)
    return packed.reshape(n, groups, 1, -1) >> amounts.reshape(1, 1, -1, 1)


def _nibbles(packed: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Low nibbles first, then high nibbles, per group: [n, groups * 2 * B / groups]."""
    return (_shifted(packed, [0, 4], groups) & 0x0F).reshape(packed.shape[0], -1)


def _bits(packed: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Bit j of byte i lands at j * width + i within each group (the k-quants' qh layout)."""
    return (_shifted(packed, list(range(8)), groups) & 1).reshape(packed.shape[0], -1)


def _le_bits(packed: torch.Tensor) -> torch.Tensor:
    """Bits of little-endian words, lowest first: element k is bit k % 8 of byte k // 8."""
    amounts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> amounts) & 1).reshape(packed.shape[0], -1)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: eight 6-bit scales and mins packed into 12 bytes -> two [n, 8] uint8."""
    n = packed.shape[0]
    grouped = packed.reshape(n, 3, 4)
    d, m, md = grouped[:, 0], grouped[:, 1], grouped[:, 2]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, minimum


# --- exported block accessors -----------------------------------------------------------


def q4_blocks(
    data: torch.Tensor, qtype: int, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K as `(q, scale, min)` with `w = scale * q + min` per 32 columns.

    q is uint8 [rows, cols] in 0..15; scale and min are float32 [rows, cols / 32]. The
    values equal `dequantize` exactly (Q4_0's implicit -8 offset becomes min = -8 * scale;
    Q4_K's super-block scales are folded into the per-32 scale and min).
    """
    rows, cols = shape
    blocks = _blocks(data, qtype, shape)
    if qtype == Q4_0:
        d = _f16(blocks, 0)
        q = _nibbles(blocks[:, 2:])
        scale, minimum = d, d * -8.0
    elif qtype == Q4_1:
        d, m = _f16(blocks, 0), _f16(blocks, 2)
        q = _nibbles(blocks[:, 4:])
        scale, minimum = d, m
    elif qtype == Q4_K:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        q = _nibbles(blocks[:, 16:], groups=4)
        scale, minimum = d * sc.float(), -(dmin * mn.float())
    else:
        raise ValueError(f"q4_blocks takes Q4_0, Q4_1 or Q4_K, not {qtype_name(qtype)}")
    groups = cols // 32
    return (
        q.reshape(rows, cols),
        scale.reshape(rows, groups),
        minimum.reshape(rows, groups),
    )


def q8_blocks(
    data: torch.Tensor, qtype: int, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 as `(q, scale)` with `w = scale * q` per 32 columns: q int8 [rows, cols],
    scale float32 [rows, cols / 32]."""
    if qtype != Q8_0:
        raise ValueError(f"q8_blocks takes Q8_0, not {qtype_name(qtype)}")
    rows, cols = shape
    blocks = _blocks(data, qtype, shape)
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return q.reshape(rows, cols), _f16(blocks, 0).reshape(rows, cols // 32)


def to_q8_0(data: torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """Q4_0 / Q5_0 / Q8_0 blocks re-encoded losslessly as Q8_0 (same fp16 d, q - 8 or q - 16
    as int8): uint8 [rows, cols / 32 * 34]. Lets fused shards of those types (llama.cpp
    mixes Q5_0 q/k with a Q8_0 v) share one block format."""
    if qtype not in Q8_0_SUBSETS:
        raise ValueError(f"to_q8_0 takes Q4_0, Q5_0 or Q8_0, not {qtype_name(qtype)}")
    rows = shape[0]
    blocks = _blocks(data, qtype, shape)
    if qtype == Q8_0:
        return blocks.reshape(rows, -1)
    if qtype == Q4_0:
        q = _nibbles(blocks[:, 2:]).to(torch.int16) - 8
    else:
        q = (_nibbles(blocks[:, 6:]) | (_le_bits(blocks[:, 2:6]) << 4)).to(torch.int16) - 16
    return torch.cat([blocks[:, :2], q.to(torch.int8).view(torch.uint8)], dim=1).reshape(rows, -1)


# --- per-format dequantization ([num_blocks, bytes] -> [num_blocks, elems]) -------------


def _q4(qtype: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        elems = _FORMATS[qtype][1]
        q, scale, minimum = q4_blocks(blocks, qtype, (n, elems))
        # uint8 * float32 promotes exactly; the in-place add saves a full-size temporary.
        out = q.reshape(n, -1, 32) * scale.unsqueeze(-1)
        return out.add_(minimum.unsqueeze(-1)).reshape(n, elems)

    return run


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:]) | (_le_bits(blocks[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:]) | (_le_bits(blocks[:, 4:8]) << 4)
    return d * q.float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q, scale = q8_blocks(blocks, Q8_0, (blocks.shape[0], 32))
    return q * scale


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (_shifted(blocks[:, 16:80], [0, 2, 4, 6], 2) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    low = (_shifted(packed[:, :8], [0, 4], 1) & 0x0F).reshape(n, 16)
    high = (_shifted(packed[:, 8:], [0, 2, 4, 6], 1) & 3).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 16, 1)
    ql = (_shifted(qs, [0, 2, 4, 6], 2) & 3).reshape(n, 16, 16).to(torch.int8)
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    qh = (_bits(hmask) ^ 1).reshape(n, 16, 16).to(torch.int8)
    return (dl * (ql - (qh << 2)).float()).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    ql = _nibbles(blocks[:, 48:], groups=4).reshape(n, 8, 32)
    qh = _bits(blocks[:, 16:48]).reshape(n, 8, 32)
    return (dl * (ql | (qh << 4)).float() - ml).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128], groups=2).reshape(n, 8, 32)
    qh = (_shifted(blocks[:, 128:192], [0, 2, 4, 6], 2) & 3).reshape(n, 8, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(dtype).float()

    return run


_DEQUANT: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType(
    {
        0: _plain(torch.float32),
        1: _plain(torch.float16),
        30: _plain(torch.bfloat16),
        Q4_0: _q4(Q4_0),
        Q4_1: _q4(Q4_1),
        6: _q5_0,
        7: _q5_1,
        Q8_0: _q8_0,
        10: _q2_k,
        11: _q3_k,
        Q4_K: _q4(Q4_K),
        13: _q5_k,
        14: _q6_k,
    }
)


def dequantize(data: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF bytes (uint8, any shape holding exactly the tensor's blocks) of a tensor
    with logical torch `shape` -> float32 of `shape` (2-D tensors: [rows, cols]).

    Raises ValueError naming the type for formats we do not decode (IQ*, TQ*, ...) and
    for a byte count that does not match the shape.
    """
    blocks = _blocks(data, qtype, tuple(shape))
    return _DEQUANT[qtype](blocks).reshape(shape)
