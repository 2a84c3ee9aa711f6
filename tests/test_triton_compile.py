"""Ahead-of-time compile of the Triton attention kernels for an H100/H200 (sm_90), no GPU
needed: catches what only the GPU compiler rejects (the interpreter accepts any tl.dot shape,
non-constexpr globals, ...) and checks shared memory fits.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")


def _compile_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object], warps: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: ("constexpr" if n in constexprs else signature.get(n, "i32")) for n in names}
    # Launches specialise 16-byte aligned pointers and strides divisible by 16; so do we.
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride_")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


AOT_VARIANTS = [
    # dtype, head_dim, group, max_query_len, window, soft cap, bidirectional, splits
    ("bf16", 128, 2, 1, False, False, False, 8),
    ("fp16", 80, 3, 512, True, True, True, 1),
    ("fp32", 16, 2, 64, True, False, False, 1),
]


def skip_unless_compilable(kernel: object) -> None:
    """Skip when triton has no ptxas, or `kernel` is interpreted (TRITON_INTERPRET=1)."""
    from triton.runtime.jit import JITFunction

    nvidia_bin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(nvidia_bin, "ptxas")):
        pytest.skip("triton ships no ptxas here")
    if not isinstance(kernel, JITFunction):
        pytest.skip("the kernels are interpreted in this process (TRITON_INTERPRET=1)")


@pytest.mark.parametrize("variant", AOT_VARIANTS, ids=lambda v: f"{v[0]}-d{v[1]}-s{v[7]}")
def test_kernels_compile_for_sm90(variant: tuple) -> None:
    from tinyvllm.attention.kernels import kv_store, split_kv
    from tinyvllm.attention.kernels import unified_attention as ua

    skip_unless_compilable(ua._attention_kernel)

    dtype, head_dim, group, max_q, window, cap, bidi, splits = variant
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    constants = ua.kernel_constants(
        torch_dtype,
        True,
        group * 2,
        2,
        head_dim,
        16,
        max_q,
        use_window=window,
        use_soft_cap=cap,
        has_bidi=bidi,
        split_kv=splits > 1,
        num_spans=2 if bidi else 1,  # several image spans per request
    )
    warps = constants.pop("num_warps")
    constants.pop("num_stages")
    ptrs = {n: f"*{dtype}" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    ptrs |= {n: "*fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")}
    ptrs |= {n: "*i32" for n in ("qsl_ptr", "seq_lens_ptr", "block_table_ptr", "bidi_ptr")}
    compiled = _compile_sm90(
        ua._attention_kernel, {**ptrs, "scale": "fp32", "soft_cap": "fp32"}, constants, warps
    )
    assert compiled.metadata.shared <= 228 * 1024  # H100/H200 shared memory per block
    head_pad = constants["HEAD_PAD"]
    if splits > 1:
        _compile_sm90(
            split_kv._reduce_splits_kernel,
            {"out_ptr": f"*{dtype}"}
            | {n: "*fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")},
            dict(HEAD_DIM=head_dim, HEAD_PAD=head_pad, MAX_SPLITS=split_kv.MAX_SPLITS),
            warps=4,
        )
    _compile_sm90(
        kv_store._store_kv_kernel,
        {n: f"*{dtype}" for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
        | {"slot_ptr": "*i64"},
        dict(NUM_KV_HEADS=2, HEAD_DIM=head_dim, HEADS_PAD=2, HEAD_PAD=head_pad, BLOCK_SIZE=16),
        warps=4,
    )
