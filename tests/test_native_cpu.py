"""The native CPU decode kernels against the PyTorch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyvllm.native import NativeCpuOps
from tinyvllm.native.build import unsupported_reason

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"native kernels unavailable: {unsupported_reason()}"
)


@pytest.fixture(scope="module")
def ops() -> NativeCpuOps:
    loaded = NativeCpuOps.load()
    assert loaded is not None
    return loaded


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest difference in units of the last place (bf16 compared by its bits)."""
    if a.dtype == torch.bfloat16:
        ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
        return int((ai - bi).abs().max())
    return -1


def _assert_as_eager(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one bf16 ulp of eager (fp32: within the default float tolerance)."""
    if got.dtype == torch.bfloat16:
        assert _ulps(got, ref) <= 1
    else:
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 21])
@pytest.mark.parametrize("n,k", [(37, 64), (96, 200), (130, 13)])
def test_linear(ops: NativeCpuOps, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = ops.linear(x, w, bias)
        assert got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), ref.to(dtype).float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_eager_bitwise_outside_statistics(
    ops: NativeCpuOps, dtype: torch.dtype
) -> None:
    from tinyvllm.models.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(3, 96, generator=gen).to(dtype)
    res = torch.randn(3, 96, generator=gen).to(dtype)
    ref_out, ref_res = norm(x, res.clone())
    res_native = res.clone()
    got = ops.rms_norm(x, res_native, norm.weight, 1e-5)
    assert torch.equal(res_native, ref_res)
    if dtype == torch.bfloat16:
        assert _ulps(got, ref_out) <= 1
    else:
        torch.testing.assert_close(got, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ops.rms_norm(x, None, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(ops: NativeCpuOps, dtype: torch.dtype) -> None:
    from tinyvllm.models.layers.activation import SiluAndMul

    x = torch.randn(4, 2 * 50, generator=torch.Generator().manual_seed(1)).to(dtype)
    _assert_as_eager(ops.silu_mul(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rope_in_place_matches_eager(
    ops: NativeCpuOps, dtype: torch.dtype, rotary_dim: int
) -> None:
    from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding

    head_dim, hq, hkv = 32, 4, 2
    cfg = RopeConfig("default", 10000.0, head_dim, rotary_dim, 256)
    rope = RotaryEmbedding(cfg, 256)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 17, 200])
    q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    ops.rope_(q, k, head_dim, rotary_dim, positions, rope.cos_cache, rope.sin_cache)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 20.0)])
# 68 and 80: the 64-wide value sums plus a scalar tail / an 8-wide remainder.
@pytest.mark.parametrize("d", [16, 68, 80])
def test_paged_decode_and_store(
    ops: NativeCpuOps, dtype: torch.dtype, window: int | None, cap: float | None, d: int
) -> None:
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks, hkv, group = 4, 32, 2, 3
    kv = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    seq_lens = torch.tensor([1, 7, 13], dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = perm[:12].view(3, 4).contiguous()
    # Write the current token's K/V through store_kv, as the backend does.
    new_k = torch.randn(3, hkv, d, generator=gen).to(dtype)
    new_v = torch.randn(3, hkv, d, generator=gen).to(dtype)
    pos = seq_lens.long() - 1
    slots = block_table.long().gather(1, (pos // block_size)[:, None])[:, 0] * block_size
    slots += pos % block_size
    ops.store_kv(new_k, new_v, kv, slots)
    flat = kv.view(2, -1, hkv, d)
    assert torch.equal(flat[0, slots], new_k) and torch.equal(flat[1, slots], new_v)

    q = torch.randn(3, hkv * group, d, generator=gen).to(dtype)
    out = torch.zeros_like(q)
    tok = torch.arange(3)
    ops.paged_decode(q, out, tok, tok, seq_lens, block_table, kv, 0.25, window, cap)
    for i in range(3):
        n = int(seq_lens[i])
        ids = block_table[i].long()
        k = kv[0][ids].reshape(-1, hkv, d)[:n].float().repeat_interleave(group, 1)
        v = kv[1][ids].reshape(-1, hkv, d)[:n].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[i].float(), k) * 0.25
        if cap:
            s = torch.tanh(s / cap) * cap
        if window:
            s[:, : max(0, n - window)] = float("-inf")
        ref = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[i].float(), ref.to(dtype).float(), rtol=tol, atol=tol)


def _row_kernels(ops: NativeCpuOps) -> None:
    if not ops.row_kernels:
        pytest.skip("the AVX-512 row kernels need avx512f and avx512bw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ["prefill", 1, 5, "max"])
def test_norm_silu_rope_take_the_row_kernels(
    ops: NativeCpuOps, dtype: torch.dtype, rows: int | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs of any size, from one decode row to a prefill chunk, go to the multi-threaded
    AVX-512 kernels where they run (the one-thread kernels' scalar expf made a 64-row decode
    step on the layers spend 19 ms of 170 in SiLU), which agree with eager as the one-thread
    kernels do: residual and rope bitwise, normed and SiLU outputs within one bf16 ulp. Widths
    leave 16-lane tails (H = 101)."""
    from tinyvllm.models.layers.activation import SiluAndMul
    from tinyvllm.models.layers.norm import RMSNorm
    from tinyvllm.models.layers.rotary import RopeConfig, RotaryEmbedding
    from tinyvllm.native.ops import MAX_ELEMENTWISE_ROWS

    _row_kernels(ops)
    called: list[str] = []
    for name in ("tv_rows_rms_norm", "tv_rows_silu_mul", "tv_rows_rope"):
        fn = getattr(ops.lib, name)
        monkeypatch.setattr(ops.lib, name, lambda *a, _f=fn, _n=name: called.append(_n) or _f(*a))
    gen = torch.Generator().manual_seed(7)
    sizes = {"prefill": MAX_ELEMENTWISE_ROWS * 3 + 5, "max": MAX_ELEMENTWISE_ROWS}
    t = sizes.get(rows, rows)
    norm = RMSNorm(101, eps=1e-5)
    norm.weight.data = torch.randn(101, generator=gen).to(dtype)
    x = (torch.randn(t, 101, generator=gen) * 3).to(dtype)
    res = torch.randn(t, 101, generator=gen).to(dtype)
    assert ops.elementwise_fits(x)
    ref_out, ref_res = norm(x, res.clone())
    res_native = res.clone()
    got = ops.rms_norm(x, res_native, norm.weight, 1e-5)
    assert torch.equal(res_native, ref_res)
    _assert_as_eager(got, ref_out)

    # Large |gate| reaches exp's overflow and underflow: silu must give -0 and the gate there.
    g = torch.randn(t, 2 * 83, generator=gen) * 4
    g[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])
    g = g.to(dtype)
    _assert_as_eager(ops.silu_mul(g), SiluAndMul()(g))

    head_dim, hq, hkv = 40, 3, 1  # half = 20: one 16-lane step and a tail
    rope = RotaryEmbedding(RopeConfig("default", 10000.0, head_dim, head_dim, 512), 512)
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (t,), generator=gen)
    q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    ops.rope_(q, k, head_dim, head_dim, positions, rope.cos_cache, rope.sin_cache)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert called == ["tv_rows_rms_norm", "tv_rows_silu_mul", "tv_rows_rope"]


def _round_bf16(ops: NativeCpuOps, x: torch.Tensor, hw: int) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.int16)
    ops.lib.tv_rows_round_bf16(x.data_ptr(), out.data_ptr(), x.numel(), hw)
    return out


def test_bf16_rounding_instruction_rounds_as_the_integer_path(ops: NativeCpuOps) -> None:
    """The row kernels round bf16 outputs with vcvtneps2bf16 where the CPU has it, which reads
    fp32 denormals as zero: vectors holding one must take the integer path, so the bits agree
    everywhere, ties, denormals, infinities and NaN payloads included (and with torch's
    rounding wherever torch keeps the payload, i.e. off NaN)."""
    _row_kernels(ops)
    gen = torch.Generator().manual_seed(11)
    special = [
        0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # denormals
        0x00008000, 0x00018000, 0x00400000, 0x3F808000, 0x3F818000, 0x3F807FFF,  # ties
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,  # overflow to inf, infinities
        0x7FC00000, 0x7F800001, 0xFFC12345, 0x7FBFFFFF,  # quiet and signalling NaNs
    ]  # fmt: skip
    bits = torch.cat([
        torch.tensor(special, dtype=torch.int64),
        torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64),
        # Whole vectors of denormals next to vectors with a single one.
        torch.randint(1, 0x800000, (16,), generator=gen, dtype=torch.int64),
        torch.full((15,), 0x3F800000, dtype=torch.int64), torch.tensor([0x00000400]),
    ])  # fmt: skip
    bits = bits[: bits.numel() // 16 * 16]
    x = bits.to(torch.int32).view(torch.float32).contiguous()
    soft = _round_bf16(ops, x, 0)
    ok = ~torch.isnan(x)
    assert torch.equal(soft[ok], x[ok].to(torch.bfloat16).view(torch.int16))
    if not ops.lib.tv_rows_bf16_hw():
        pytest.skip("no AVX512-BF16 here: only the integer path runs")
    assert torch.equal(_round_bf16(ops, x, 1), soft)


def test_row_kernels_keep_denormal_outputs(ops: NativeCpuOps) -> None:
    """Residual sums and normalised outputs that are fp32 denormals round to bf16 denormals as
    eager's do (vcvtneps2bf16 alone would give zeros)."""
    from tinyvllm.models.layers.norm import RMSNorm

    _row_kernels(ops)
    gen = torch.Generator().manual_seed(12)
    t, h = 3, 64
    norm = RMSNorm(h, eps=1e-5)
    norm.weight.data = torch.full((h,), 1e-38).to(torch.bfloat16)  # out = w * normed: denormal
    x = (torch.rand(t, h, generator=gen) * 4e-39).to(torch.bfloat16)
    res = (torch.rand(t, h, generator=gen) * 4e-39).to(torch.bfloat16)
    x[2] = torch.randn(h, generator=gen).to(torch.bfloat16)  # one ordinary row
    ref_out, ref_res = norm(x, res.clone())
    res_native = res.clone()
    got = ops.rms_norm(x, res_native, norm.weight, 1e-5)
    assert (ref_res[:2] != 0).any() and ref_res[:2].abs().max() < 1.2e-38
    assert torch.equal(res_native, ref_res)
    assert (got != 0).any() and _ulps(got, ref_out) <= 1


def test_silu_mul_of_fp32_rows_is_the_bf16_path_bit_for_bit(ops: NativeCpuOps) -> None:
    """silu_mul_bf16_in_f32 on an fp32 GEMM output equals converting it to bf16, silu_mul on
    bf16 and converting back, bit for bit: ties and values between bf16 neighbours, exp's
    overflow and underflow, and a width with a 16-lane tail (D = 83)."""
    _row_kernels(ops)
    gen = torch.Generator().manual_seed(13)
    y = torch.randn(37, 2 * 83, generator=gen) * 4
    y[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])
    y[1, :3] = torch.tensor([1.00390625, 1.01171875, -3.0078125])  # bf16 ties
    want = ops.silu_mul(y.bfloat16()).float()
    assert torch.equal(ops.silu_mul_bf16_in_f32(y), want)


@pytest.mark.parametrize("row_kernels", [True, False])
@pytest.mark.parametrize(
    ("block_rows", "blocks"),
    [(None, [70]), (25, [24, 23, 23]), (9, [9] * 6 + [8] * 2)],
)
def test_gated_mlp_on_fp32_gemm_copies_is_the_plain_path_bit_for_bit(
    ops: NativeCpuOps,
    block_rows: int | None,
    blocks: list[int],
    row_kernels: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MLP of bf16 rows on fp32 GEMM copies runs in row blocks under the byte budget (with
    the row kernels its activation stays in fp32 storage between the GEMMs, without them it
    is bf16) and gives the bits of the plain unblocked path: in one block, in three, and in
    eight of which the last two (8 rows) are under the copies' 9 and take the plain path."""
    from types import SimpleNamespace

    import tinyvllm.models.layers.gated_mlp as gated
    from tinyvllm.models.layers.linear import attach_fp32_gemm_weights
    from tinyvllm.models.llama import LlamaMLP

    if block_rows is not None:  # 320 gate / up columns of 4 bytes per row
        monkeypatch.setattr(gated, "FP32_BLOCK_BYTES", block_rows * 320 * 4)
    if row_kernels:
        _row_kernels(ops)
    gen = torch.Generator().manual_seed(14)
    config = SimpleNamespace(hidden_size=96, intermediate_size=160, hidden_act="silu")
    mlp = LlamaMLP(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    mlp.act.native = ops
    monkeypatch.setattr(ops, "row_kernels", row_kernels)
    attach_fp32_gemm_weights(mlp, min_rows=9)
    x = torch.randn(70, 96, generator=gen).bfloat16()
    want = mlp.down_proj(mlp.act(mlp.gate_up_proj(x)))  # the plain path, one piece

    seen: list[int] = []
    gemm, silu = mlp.gate_up_proj.fp32_gemm, ops.silu_mul_bf16_in_f32
    monkeypatch.setattr(mlp.gate_up_proj, "fp32_gemm", lambda t: seen.append(len(t)) or gemm(t))
    fused: list[int] = []
    monkeypatch.setattr(ops, "silu_mul_bf16_in_f32", lambda t: fused.append(len(t)) or silu(t))
    got = mlp(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert seen == blocks
    on_copies = [n for n in blocks if n >= 9]
    assert fused == (on_copies if row_kernels else [])
    seen.clear()
    assert torch.equal(mlp(x[:5]), mlp.down_proj(mlp.act(mlp.gate_up_proj(x[:5]))))
    assert seen == [5]  # asked once, refused: too few rows for the GEMM copies
