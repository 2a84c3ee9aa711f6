"""One launch of paged attention for a mixed batch of prefill chunks and decodes.

Grid: (T // BLOCK_Q + num_reqs + 1 query blocks, KV heads, KV splits). A query block holds
up to BLOCK_Q consecutive query tokens of one request times the GROUP query heads sharing one
KV head, packed into the BLOCK_M rows of the tiles (so GQA/MQA read each K/V tile once per
group). Request r owns blocks [qsl[r] // BLOCK_Q + r, qsl[r + 1] // BLOCK_Q + r + 1), enough
for its query tokens wherever they start; a program finds its request by binary search. The
blocks after the last request's cover the padded tokens past qsl[num_reqs] as a pseudo request
with no context: their rows are written as zeros, so the output is finite everywhere.

Each program walks its keys in TILE_N tiles through the block table with an online softmax
in fp32 (exp2 domain). With SPLIT_KV (flash decoding) each of `num_splits` programs covers one
contiguous share of its tiles and writes unnormalised partials that `split_kv.reduce_splits`
combines.

Visibility of key j to the query at position i: j < seq_len, i - j < window, and either j <= i
or both i and j lie in one of the request's bidirectional spans [start, end).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tinyvllm.attention.kernels.split_kv import alloc_partials, choose_num_splits, reduce_splits

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _find_request(qsl_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """Largest r in [0, num_reqs] with qsl[r] // BLOCK_Q + r <= q_block (num_reqs: tail)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        fits = first_block <= q_block
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    return lo


# Runtime ints that vary step to step are not specialised (no recompiles mid-run); the split
# factor is a runtime value too, so flash decoding adds one compiled variant, not one per factor.
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "window", "num_splits"])
def _attention_kernel(
    out_ptr,  # [T, Hq, D]  (not SPLIT_KV)
    part_acc_ptr,  # [T, Hq, num_splits, HEAD_PAD] fp32  (SPLIT_KV)
    part_max_ptr,  # [T, Hq, num_splits] fp32, running max in the exp2 domain
    part_sum_ptr,  # [T, Hq, num_splits] fp32
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    qsl_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_table_ptr,  # [num_reqs, max_blocks] int32
    bidi_ptr,  # [num_reqs, NUM_SPANS, 2] int32 (HAS_BIDI)
    scale,
    soft_cap,
    window,
    num_tokens,
    num_reqs,
    num_q_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    HAS_BIDI: tl.constexpr,
    NUM_SPANS: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(qsl_ptr, num_reqs, q_block, BLOCK_Q)
    is_real = req < num_reqs
    q_start = tl.load(qsl_ptr + req)
    # Scalar loads clamp their index instead of masking: the tail pseudo request
    # (req == num_reqs) has no entries of its own.
    last_req = tl.maximum(tl.minimum(req, num_reqs - 1), 0)
    q_end = tl.where(is_real, tl.load(qsl_ptr + req + is_real.to(tl.int32)), num_tokens)
    seq_len = tl.where(is_real, tl.load(seq_lens_ptr + last_req), 0)
    q_len = q_end - q_start
    first_q = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first_q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    q_idx = first_q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    context_len = seq_len - q_len
    q_pos = context_len + q_idx  # absolute position (negative only for padding rows)

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this block may see: [kv_lo, kv_hi).
    first_pos = context_len + first_q
    last_pos = context_len + tl.minimum(first_q + BLOCK_Q, q_len) - 1
    kv_hi = tl.minimum(seq_len, last_pos + 1)
    kv_lo = first_pos * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
    if HAS_BIDI:
        # Each query row's own span [row_lo, row_hi) (a request's spans are disjoint; empty
        # outside them). Later keys of a span become visible to its queries; earlier ones stay
        # bounded by the window.
        row_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        row_hi = tl.zeros([BLOCK_M], dtype=tl.int32)
        for span in tl.static_range(NUM_SPANS):
            entry = bidi_ptr + (last_req * NUM_SPANS + span) * 2
            span_lo = tl.where(is_real, tl.load(entry), 0)
            span_hi = tl.where(is_real, tl.load(entry + 1), 0)
            inside = row_ok & (q_pos >= span_lo) & (q_pos < span_hi)
            row_lo = tl.where(inside, span_lo, row_lo)
            row_hi = tl.where(inside, span_hi, row_hi)
        kv_hi = tl.minimum(seq_len, tl.maximum(kv_hi, tl.max(row_hi, 0)))
    kv_hi = tl.maximum(kv_hi, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.maximum(tl.cdiv(kv_hi, TILE_N), tile_lo)
    if SPLIT_KV:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tl.minimum(tile_lo + split * per_split, tile_hi)
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + last_req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = offs_n < kv_hi
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(  # [HEAD_PAD, TILE_N]: already transposed for the dot
            k_cache_ptr
            + block[None, :] * stride_kb
            + in_block[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None],
            mask=key_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(  # [TILE_N, HEAD_PAD]
            v_cache_ptr
            + block[:, None] * stride_vb
            + in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            s = tl.dot(q, k)
        if USE_SOFT_CAP:
            # cap * tanh(x / cap), with tanh written through exp2 (no libdevice dependency).
            x = s * (scale / soft_cap)
            s = soft_cap * (1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)) * LOG2E
        else:
            s = s * (scale * LOG2E)
        diff = q_pos[:, None] - offs_n[None, :]
        visible = diff >= 0
        if HAS_BIDI:
            same_span = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
            visible = visible | same_span
        if USE_WINDOW:  # after the span: the window bounds its keys too (as transformers)
            visible = visible & (diff < window)
        visible = visible & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        # UPCAST is a constexpr: the compiler keeps one branch.
        pv = tl.dot(p, v, input_precision=DOT_PRECISION) if UPCAST else tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if not SPLIT_KV:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (token * num_q_heads + head) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None]
        )


def block_shape(num_q_heads: int, num_kv_heads: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per program and the query tokens they cover.

    tl.dot needs M >= 16 on GPUs; decode-like batches get 16 rows (little waste), prefills
    64 so that each K/V tile is reused by more queries.
    """
    group = num_q_heads // num_kv_heads
    rows = 16 if max_query_len * group <= 16 else 64
    block_m = max(rows, triton.next_power_of_2(group))
    return block_m, block_m // group


def kernel_constants(
    dtype: torch.dtype,
    on_gpu: bool,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    *,
    use_window: bool,
    use_soft_cap: bool,
    has_bidi: bool,
    split_kv: bool,
    num_spans: int = 1,
) -> dict[str, Any]:
    """The attention kernel's constexprs plus num_warps / num_stages for one launch."""
    block_m, block_q = block_shape(num_q_heads, num_kv_heads, max_query_len)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # Off-GPU means Triton's interpreter, whose bf16 arithmetic is wrong: bf16 is computed in
    # fp32 there (fp16 keeps the GPU's code path). fp32 dots on GPUs use 3xTF32 (~fp32
    # accuracy on tensor cores; exact fp32 dots spill registers badly).
    upcast = dtype == torch.float32 or (dtype == torch.bfloat16 and not on_gpu)
    return {
        "HEAD_DIM": head_dim,
        "HEAD_PAD": head_pad,
        "GROUP": num_q_heads // num_kv_heads,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_q,
        # K + V tiles of at most 32 KiB per pipeline stage.
        "TILE_N": 64 if head_pad * (4 if upcast else 2) <= 256 else 32,
        "BLOCK_SIZE": block_size,
        "USE_WINDOW": use_window,
        "USE_SOFT_CAP": use_soft_cap,
        "HAS_BIDI": has_bidi,
        "NUM_SPANS": num_spans,
        "SPLIT_KV": split_kv,
        "UPCAST": upcast,
        "DOT_PRECISION": "tf32x3" if on_gpu else "ieee",
        "num_warps": 4 if block_m <= 64 else 8,
        "num_stages": 2,
    }


def unified_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    bidirectional_ranges: torch.Tensor | None = None,
    num_splits: int | None = None,
    num_sms: int = 132,
) -> None:
    """Causal paged attention of query [T, Hq, D] into out [T, Hq, D].

    k_cache/v_cache: [num_blocks, block_size, Hkv, D]. Launch parameters depend only on
    tensor shapes, the layer constants and the Python ints `max_query_len` / `max_seq_len`
    (upper bounds), so the call is CUDA-graph capturable. `num_splits` overrides the
    split-KV heuristic.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_reqs = query_start_loc.shape[0] - 1
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_reqs <= 0:
        return
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("query, KV cache and output need a contiguous head_dim")
    _, block_q = block_shape(num_q_heads, num_kv_heads, max_query_len)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_reqs, num_kv_heads, max_query_len, max_seq_len, block_q, num_sms
        )
    use_window = sliding_window is not None and sliding_window > 0
    use_cap = bool(soft_cap)
    has_bidi = bidirectional_ranges is not None
    bidi = bidirectional_ranges.to(torch.int32).contiguous() if has_bidi else seq_lens
    num_spans = bidi.shape[1] if has_bidi and bidi.dim() == 3 else 1
    constants = kernel_constants(
        query.dtype,
        query.device.type == "cuda",
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_query_len,
        use_window=use_window,
        use_soft_cap=use_cap,
        has_bidi=has_bidi,
        split_kv=num_splits > 1,
        num_spans=num_spans,
    )
    if num_splits > 1:
        part_acc, part_max, part_sum = alloc_partials(query, num_splits, constants["HEAD_PAD"])
    else:
        part_acc = part_max = part_sum = out  # unused
    grid = (num_tokens // block_q + num_reqs + 1, num_kv_heads, num_splits)
    _attention_kernel[grid](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        bidi,
        float(scale),
        float(soft_cap) if use_cap else 1.0,
        int(sliding_window) if use_window else 0,
        num_tokens,
        num_reqs,
        num_q_heads,
        num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        **constants,
    )
    if num_splits > 1:
        reduce_splits(out, part_acc, part_max, part_sum)
