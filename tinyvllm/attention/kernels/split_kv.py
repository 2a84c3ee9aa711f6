"""Split-KV ("flash decoding") support: when to split, the partial buffers, and the reduce.

With more than one split, every attention program covers one contiguous share of its query
block's key tiles and stores, per (token, query head, split), its running max (exp2 domain),
its sum of exponentials and its unnormalised output; `reduce_splits` merges them into the
final output. A split with no keys stores max -inf, sum 0 and output 0, and drops out."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Flash decoding: split a request's keys only while the grid would leave SMs idle, and never
# into shares of fewer than this many keys (each split re-reads its query and adds a partial).
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    block_q: int,
    num_sms: int,
) -> int:
    """KV splits per query block (a power of two): > 1 only for decode-like batches (each
    request's queries fit one block) with few (request, KV head) programs and long contexts."""
    if max_query_len > block_q:
        return 1
    programs = max(num_reqs * num_kv_heads, 1)
    splits = min((2 * num_sms) // programs, max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return 1 if splits <= 1 else 1 << (splits.bit_length() - 1)


def alloc_partials(
    query: torch.Tensor, num_splits: int, head_pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 partials: output [T, Hq, splits, head_pad], max and sum [T, Hq, splits]."""
    num_tokens, num_q_heads, _ = query.shape
    acc = torch.empty(
        (num_tokens, num_q_heads, num_splits, head_pad), dtype=torch.float32, device=query.device
    )
    stats = torch.empty(
        (2, num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=query.device
    )
    return acc, stats[0], stats[1]


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    used = offs_s < num_splits
    part = (token * num_q_heads + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + part, mask=used, other=float("-inf"))
    total_max = tl.max(m, 0)
    shift = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.exp2(m - shift)  # 0 for empty and unused splits
    denom = tl.sum(weight * tl.load(part_sum_ptr + part, mask=used, other=0.0), 0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], mask=used[:, None], other=0.0
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def reduce_splits(
    out: torch.Tensor, part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor
) -> None:
    """Merge the partials into out [T, Hq, D] (every row is written)."""
    num_tokens, num_q_heads, head_dim = out.shape
    num_splits, head_pad = part_acc.shape[2], part_acc.shape[3]
    _reduce_splits_kernel[(num_tokens, num_q_heads)](
        out,
        part_acc,
        part_max,
        part_sum,
        num_q_heads,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        MAX_SPLITS=max(MAX_SPLITS, triton.next_power_of_2(num_splits)),
        num_warps=4,
    )
